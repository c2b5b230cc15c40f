"""``thinkgate bench learn``: the learning curve of the gateway's own router, on recorded traces, through the real
gateway.

    thinkgate bench learn --traces DIR --dataset frames --ladder Qwen3-14B:no_think,exd0 --feedback-rate 0.25 \\
        --steps 100,200,400,800 --json OUT.json [--png OUT.png]

What runs (all on loopback): Redis (the configured one when it answers — the run uses its own key prefix,
deleted afterwards — else a private ``redis-server``), the trace-replay upstream (:mod:`bench.traces.replay_upstream`)
and two ``thinkgate serve`` processes of **one deployment** (same Redis prefix, same router files), one tier per
ladder setting (:func:`bench.traces.bench.tier_configs`, no cascade), the shipped default router
(``router/assets/default.skops``: it serves prompt length) as ``routing.router_path``:

- the **traffic** replica: ``routing.retrain.every_outcomes: N`` (``--every-outcomes``), ``explore``
  (``--explore``: the share of routed requests sent one tier down, so that cheap answers exist to learn from),
  the spot-check arm (``--spot-check``: the share of its cheap decisions the top tier serves, the realised
  floor's control arm), shadow comparisons (``--shadow``, judge ``--judge``) and ``retain_text``;
- the **measurement** replica: retraining on with ``fit_here: false`` (it serves what the traffic replica
  promoted, never fits), no shadow, no exploration, no spot checks. Its requests are never graded, shadowed or
  escalated, so they feed no outcomes.

Traffic: the data set's questions outside the held-out split (:func:`router.fit.traces.heldout_mask`), shuffled
(``--seed``), reshuffled for every further pass when ``--steps`` asks for more requests than there are questions;
``model: auto``, ``--concurrency`` in flight. For a ``--feedback-rate`` share of the answered requests (seeded) the
bench sends ``POST /v1/feedback`` with the recorded grade of the answer served (``x-thinkgate-tier``'s setting):
the stand-in for a user's thumbs. At each step count: the bench waits until no fit is due or running (bounded),
reads the version the measurement replica serves (``GET /v1/models``), and sends every held-out question once
through it. **served** = that router at its own thresholds: accuracy (recorded grading of the tier that answered) /
always-top accuracy, token_share = completion tokens (metering ledger) / always-top's (the held-out questions sent
once with ``model: <top>`` at the start), savings = 1 − token_share, holds_floor = accuracy ≥ 98% of always-top.

Reference lines, on the same held-out questions through gateways of their own: ``offline_fit`` — the router
``thinkgate router fit --traces`` fits on all non-held-out questions of the data set
(:func:`router.fit.ladder_fit.fit_ladder_router`, its served policy); ``length`` — the same fit forced to prompt
length (``policy="length"``: length calibrated on those questions).

JSON (``--json``), exactly::

    {"dataset", "ladder", "feedback_rate",
     "steps": [{"requests", "outcomes", "router_version",
                "served": {"accuracy_ratio", "token_share", "savings", "holds_floor"}, "shadow_cost_usd"}],
     "offline_fit": {"accuracy_ratio", "token_share", "savings", "holds_floor"}, "length": {...}}

``outcomes`` = entries in the outcome stream at the step; ``shadow_cost_usd`` = the shadow calls' spend so far
(the usage ledger's all-time counter of the key ``_shadow``, ``p usage:key:_shadow``: what metering counted for
the shadow and judge calls). Progress goes to stderr; the table and a summary of the run (promotions, traffic accuracy,
timings) to stdout; everything, the retraining's audit events included (``history``), to ``--details``.
"""

from __future__ import annotations

import json
import random
import secrets
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import typer

from bench._lib.redis_keys import bench_redis
from bench.traces.bench import REQUEST_TIMEOUT_S, gateway_config, tier_configs
from bench.traces.prices import price_of
from bench.traces.replay_upstream import ReplayProcess
from gateway.config import DEFAULT_ROUTER_PATH, Settings
from router.fit.traces import HELDOUT_FRAC, LadderData, heldout_mask, load_ladder, parse_ladder

FLOOR = 0.98


class LearnBenchError(RuntimeError):
    """The bench could not run (bad arguments, a missing file, a stack part that did not start)."""


@dataclass
class Config:
    """Arguments of one run (module doc)."""

    traces: Path
    dataset: str
    ladder: str
    feedback_rate: float = 0.25
    steps: tuple[int, ...] = (100, 200, 400, 800)
    every_outcomes: int = 25
    explore: float = 0.5
    shadow: float = 1.0
    judge: str = "normalised"
    concurrency: int = 4
    seed: int = 0
    time_budget_s: float = 540.0
    router: Path = DEFAULT_ROUTER_PATH
    progress: bool = True
    spot_check: float = 0.05


class Client:
    """One replica's HTTP client with the bench key."""

    def __init__(self, url: str, secret: str, concurrency: int) -> None:
        self.url = url
        self.headers = {"authorization": f"Bearer {secret}"}
        self.http = httpx.Client(limits=httpx.Limits(max_connections=concurrency + 2), trust_env=False,
                                 timeout=REQUEST_TIMEOUT_S)

    def ask(self, question: str, model: str = "auto") -> tuple[int, str | None, str | None]:
        """(status, answering tier, request id)."""
        body = {"model": model, "messages": [{"role": "user", "content": question}]}
        try:
            r = self.http.post(self.url + "/v1/chat/completions", json=body, headers=self.headers)
        except httpx.HTTPError:
            return 0, None, None
        return r.status_code, r.headers.get("x-thinkgate-tier"), r.headers.get("x-request-id")

    def feedback(self, request_id: str, correct: bool) -> int:
        try:
            return self.http.post(self.url + "/v1/feedback", json={"request_id": request_id, "correct": correct},
                                  headers=self.headers).status_code
        except httpx.HTTPError:
            return 0

    def status(self) -> dict[str, Any]:
        """``router_status`` of ``GET /v1/models``."""
        r = self.http.get(self.url + "/v1/models", headers=self.headers)
        r.raise_for_status()
        return dict(r.json()["data"][0]["thinkgate"]["router_status"] or {})

    def close(self) -> None:
        self.http.close()


def traffic_order(train: np.ndarray, total: int, seed: int) -> list[int]:
    """``total`` question indices from ``train``: seeded shuffles, one after another."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < total:
        perm = [int(i) for i in train]
        rng.shuffle(perm)
        out += perm
    return out[:total]


def served_of(correct: np.ndarray, tokens: float, top_acc: float, top_tokens: float) -> dict[str, Any]:
    """The ``served`` block: accuracy ratio, token share, savings, floor (module doc)."""
    acc = float(np.mean(correct)) if correct.size else 0.0
    share = tokens / top_tokens if top_tokens else 1.0
    return {"accuracy_ratio": round(acc / top_acc, 6) if top_acc else 1.0, "token_share": round(share, 6),
            "savings": round(1.0 - share, 6), "holds_floor": bool(acc >= FLOOR * top_acc - 1e-12)}


def measure(client: Client, ledger: Any, key_id: str, data: LadderData, held: np.ndarray,
            settings: tuple[str, ...], concurrency: int, model: str = "auto"
            ) -> tuple[np.ndarray, float, dict[str, int]]:
    """Send each held-out question once; (correct per question, ledger completion tokens, tier counts).

    The tokens are every upstream call the measurement made: the answers' events and the escalated first attempts,
    which are metered under request ids of their own (not the client's ``x-request-id``) — counting the answers'
    alone read o3-mini's offline fit at 30.6% savings where the ledger says 23.1%. They are the events of
    ``key_id`` created between the measurement's first request and its last answer (measurements with one key run
    one after the other), waited for until every answer's event is in."""
    idx = {s: j for j, s in enumerate(settings)}
    t0 = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda q: client.ask(data.questions[int(q)], model), held))
    t1 = time.time()
    correct = np.array([bool(data.correct[int(q), idx[t]]) if st == 200 and t in idx else False
                        for q, (st, t, _) in zip(held, res, strict=True)])
    tiers: dict[str, int] = {}
    for _, t, _ in res:
        tiers[str(t)] = tiers.get(str(t), 0) + 1
    ids = {rid for st, _, rid in res if st == 200 and rid}
    events: list[Any] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # this measurement's events only (created between t0 and t1)
        events = [e for e in ledger.events(t0 - 1.0, t1 + 1.0, {key_id}) if t0 <= e.ts <= t1]
        if {e.request_id for e in events} >= ids:
            break
        time.sleep(0.2)
    return correct, float(sum(e.completion_tokens for e in events if not e.cached)), tiers


def _redis_int(url: str, fn: Any) -> int:
    import redis

    c = redis.Redis.from_url(url)
    try:
        return int(fn(c) or 0)
    finally:
        c.close()


def shadow_spend_usd(url: str, prefix: str) -> float:
    """The shadow calls' spend so far in USD: ``cost_micro_usd`` of the key ``_shadow``'s all-time usage counters
    (``p usage:key:_shadow``), what metering counted — the gateway keeps no other shadow spend counter."""
    return _redis_int(url, lambda c: c.hget(prefix + "usage:key:_shadow", "cost_micro_usd")) / 1e6


def wait_settled(url: str, prefix: str, every: int, traffic: Client, timeout_s: float = 60.0) -> None:
    """Until no fit is due (outcomes < fitted_at + every) and none is running on the traffic replica (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = _redis_int(url, lambda c: c.xlen(prefix + "outcomes"))
        fitted = _redis_int(url, lambda c: c.get(prefix + "router:fitted_at"))
        learning = (traffic.status().get("learning") or {})
        if n < fitted + every and not learning.get("fitting"):
            return
        time.sleep(0.3)


def wait_version(measure_c: Client, traffic: Client, timeout_s: float = 20.0) -> str | None:
    """The version both replicas serve, once the measurement replica follows the traffic one (bounded)."""
    deadline = time.monotonic() + timeout_s
    want = traffic.status().get("version")
    while time.monotonic() < deadline:
        got = measure_c.status().get("version")
        if got == want:
            return str(got) if got is not None else None
        time.sleep(0.3)
    return str(measure_c.status().get("version"))


def _inputs(cfg: Config) -> tuple[Any, Any]:
    """The ladder and its recorded outcomes, checked; raises LearnBenchError with the reason."""
    from router.persistence import load_router

    try:
        lad = parse_ladder(cfg.ladder)
    except ValueError as exc:
        raise LearnBenchError(str(exc)) from None
    if len(lad.settings) != 2:
        raise LearnBenchError("automatic retraining learns two routed tiers: give a ladder of 2 settings")
    if not cfg.steps or list(cfg.steps) != sorted(set(cfg.steps)) or cfg.steps[0] < 1:
        raise LearnBenchError("--steps: ascending positive request counts, e.g. 100,200,400,800")
    try:
        data = load_ladder(cfg.traces, cfg.dataset, lad)
    except (FileNotFoundError, ValueError) as exc:
        raise LearnBenchError(str(exc)) from None
    if len(load_router(cfg.router).thresholds) != 1:
        raise LearnBenchError(f"router {cfg.router} needs one threshold for a 2-setting ladder")
    return lad, data


def run(cfg: Config, settings: Settings, log: Any = lambda m: print(m, file=sys.stderr)
        ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the bench; returns (the JSON report, details)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bench.savings_stack import Ledger, serve_gateway
    from router.fit.ladder_fit import fit_ladder_router
    from router.persistence import save_router

    started = time.time()
    deadline = time.monotonic() + cfg.time_budget_s
    lad, data = _inputs(cfg)
    hmask = heldout_mask(data, HELDOUT_FRAC)
    held, train = np.flatnonzero(hmask), np.flatnonzero(~hmask)
    settings_t = lad.settings
    top = settings_t[-1]
    price = price_of(lad.model)
    run_id = uuid.uuid4().hex[:8]
    prefix = f"tgbench:learn:{run_id}:"
    keys = {n: (f"learn-{run_id}-{n}", "tg-" + secrets.token_hex(16)) for n in ("traffic", "measure", "ref")}
    key_cfg = [{"id": k, "secret": s, "tags": {"bench": "learn", "role": n}} for n, (k, s) in keys.items()]
    details: dict[str, Any] = {"run": run_id, "n_heldout": int(held.size), "n_train": int(train.size),
                               "price": {"input": str(price.input), "output": str(price.output),
                                         "source": price.source},
                               "every_outcomes": cfg.every_outcomes, "explore": cfg.explore,
                               "spot_check": cfg.spot_check, "shadow": cfg.shadow,
                               "judge": cfg.judge, "seed": cfg.seed, "router": str(cfg.router)}
    steps: list[dict[str, Any]] = []
    with ExitStack() as stack:
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tg-learn-")))
        settings = bench_redis(stack, settings, prefix)
        redis_url = settings.redis.url
        t0 = time.monotonic()
        # ---- the offline references (fitted here, served through gateways of their own)
        offline = fit_ladder_router(cfg.traces, [cfg.dataset], lad).router
        length = fit_ladder_router(cfg.traces, [cfg.dataset], lad, policy="length").router
        save_router(offline, state / "offline.skops")
        save_router(length, state / "length.skops")
        details["offline_policy"] = (offline.metadata.get("serving") or {}).get("policy")
        details["length_policy"] = (length.metadata.get("serving") or {}).get("policy")
        replay = stack.enter_context(ReplayProcess(cfg.traces, cfg.dataset, [(lad.model, s) for s in settings_t]))
        tiers = tier_configs(lad.model, settings_t, replay.base_url, price, None)

        def gw(name: str, router: Path, retrain: dict[str, Any] | None, shadow: float, explore: float) -> str:
            data_cfg = gateway_config(settings, tiers, router, key_cfg, prefix, state, name)
            r = data_cfg["routing"]
            r["outcomes"] = {**r.get("outcomes", {}), "retain_text": True}
            r["shadow"] = {**r.get("shadow", {}), "fraction": shadow, "judge": cfg.judge, "max_usd_day": "1000",
                           "max_concurrency": 8}
            r["drift"] = {**r.get("drift", {}), "enabled": False}
            if retrain is not None:
                r["retrain"] = {"state_dir": str(state / "routers"), "interval_s": 0.3, "explore": explore,
                                "spot_check": cfg.spot_check if name == "traffic" else 0.0, **retrain}
            return str(stack.enter_context(serve_gateway(data_cfg, state, f"gateway-{name}")))

        url_t = gw("traffic", cfg.router, {"every_outcomes": cfg.every_outcomes}, cfg.shadow, cfg.explore)
        url_m = gw("measure", cfg.router, {"every_outcomes": cfg.every_outcomes, "fit_here": False}, 0.0, 0.0)
        url_o = gw("offline", state / "offline.skops", None, 0.0, 0.0)
        url_l = gw("length", state / "length.skops", None, 0.0, 0.0)
        details["startup_s"] = round(time.monotonic() - t0, 1)
        ledger = Ledger(settings.model_copy(update={"redis": settings.redis.model_copy(
            update={"key_prefix": prefix})}))
        traffic = stack.enter_context(_closing(Client(url_t, keys["traffic"][1], cfg.concurrency)))
        meas = stack.enter_context(_closing(Client(url_m, keys["measure"][1], cfg.concurrency)))
        ref_o = stack.enter_context(_closing(Client(url_o, keys["ref"][1], cfg.concurrency)))
        ref_l = stack.enter_context(_closing(Client(url_l, keys["ref"][1], cfg.concurrency)))
        top_correct, top_tok, _ = measure(meas, ledger, keys["measure"][0], data, held, settings_t, cfg.concurrency,
                                          top)
        top_acc = float(np.mean(top_correct))
        details["always_top_accuracy"] = round(top_acc, 6)
        ref: dict[str, dict[str, Any]] = {}
        for name, client in (("offline_fit", ref_o), ("length", ref_l)):
            c, tok, tiers_m = measure(client, ledger, keys["ref"][0], data, held, settings_t, cfg.concurrency)
            ref[name] = served_of(c, tok, top_acc, top_tok)
            details[f"{name}_tiers"] = tiers_m
        c0, tok0, tiers0 = measure(meas, ledger, keys["measure"][0], data, held, settings_t, cfg.concurrency)
        details["step0"] = {"router_version": meas.status().get("version"),
                            "served": served_of(c0, tok0, top_acc, top_tok), "tiers": tiers0}
        order = traffic_order(train, cfg.steps[-1], cfg.seed)
        fb_rng = random.Random(cfg.seed + 1)
        fb_draw = [fb_rng.random() < cfg.feedback_rate for _ in order]
        idx = {s: j for j, s in enumerate(settings_t)}
        counters = {"answered": 0, "feedback": 0, "traffic_correct": 0, "cheap_answers": 0, "errors": 0}
        lock = threading.Lock()

        def count(**kw: int) -> None:
            with lock:
                for k, v in kw.items():
                    counters[k] += v

        def one(i: int) -> None:
            q = order[i]
            st, tier, rid = traffic.ask(data.questions[q])
            if st != 200 or tier not in idx or rid is None:
                count(errors=1)
                return
            ok = bool(data.correct[q, idx[tier]])
            graded = int(fb_draw[i] and traffic.feedback(rid, ok) == 200)
            count(answered=1, traffic_correct=int(ok), cheap_answers=int(tier != top), feedback=graded)

        sent = 0
        progress = Progress(TextColumn(f"bench learn {lad.name}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), disable=not cfg.progress,
                            console=None)
        with progress, ThreadPoolExecutor(cfg.concurrency) as pool:
            task = progress.add_task("traffic", total=cfg.steps[-1], info="")
            for target in cfg.steps:
                if time.monotonic() > deadline:
                    log(f"time budget reached before step {target}: stopping")
                    break
                for _ in pool.map(one, range(sent, target)):
                    progress.advance(task)
                sent = target
                wait_settled(redis_url, prefix, cfg.every_outcomes, traffic)
                version = wait_version(meas, traffic)
                c, tok, tiers_s = measure(meas, ledger, keys["measure"][0], data, held, settings_t, cfg.concurrency)
                n_out = _redis_int(redis_url, lambda cl: cl.xlen(prefix + "outcomes"))
                step = {"requests": target, "outcomes": n_out, "router_version": version,
                        "served": served_of(c, tok, top_acc, top_tok),
                        "shadow_cost_usd": round(shadow_spend_usd(redis_url, prefix), 6)}
                steps.append(step)
                details.setdefault("step_tiers", []).append(tiers_s)
                progress.update(task, info=f"{target}: {version} savings {step['served']['savings']:.1%}")
        import redis as _redis

        rc = _redis.Redis.from_url(redis_url)
        try:
            details["history"] = [json.loads(f[b"e"]) for _, f in rc.xrange(prefix + "router:history")]
        finally:
            rc.close()
        details.update({k: v for k, v in counters.items()})
        details["traffic_accuracy_ratio"] = round(counters["traffic_correct"] / max(1, counters["answered"])
                                                  / top_acc, 6) if top_acc else None
    details["wall_s"] = round(time.time() - started, 1)
    details["complete"] = len(steps) == len(cfg.steps)
    report = {"dataset": cfg.dataset, "ladder": lad.name, "feedback_rate": cfg.feedback_rate, "steps": steps,
              "offline_fit": ref["offline_fit"], "length": ref["length"]}
    return report, details


class _closing:
    def __init__(self, c: Client) -> None:
        self.c = c

    def __enter__(self) -> Client:
        return self.c

    def __exit__(self, *exc: object) -> None:
        self.c.close()


# ---------------------------------------------------------------------------------------------- outputs


def render(report: dict[str, Any], details: dict[str, Any]) -> Any:
    """A rich table: one row per step, then the offline fit and length."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"ThinkGate learning on {report['dataset']} {report['ladder']} "
                    f"(feedback {report['feedback_rate']:.0%}; served on {details['n_heldout']} held-out questions)")
    for c in ("requests", "outcomes", "router version", "accuracy / top", "token share", "savings", "floor",
              "shadow USD"):
        t.add_column(c, justify="left" if c == "router version" else "right")
    for s in report["steps"]:
        v = s["served"]
        t.add_row(str(s["requests"]), str(s["outcomes"]), str(s["router_version"]), f"{v['accuracy_ratio']:.3f}",
                  f"{v['token_share']:.1%}", f"{v['savings']:.1%}", "yes" if v["holds_floor"] else "NO",
                  f"{s['shadow_cost_usd']:.4f}")
    for name in ("offline_fit", "length"):
        v = report[name]
        t.add_row(name, "", str(details.get(f"{name.split('_')[0]}_policy", "")), f"{v['accuracy_ratio']:.3f}",
                  f"{v['token_share']:.1%}", f"{v['savings']:.1%}", "yes" if v["holds_floor"] else "NO", "")
    prom = sum(1 for e in details.get("history", []) if e.get("event") == "promote")
    rb = sum(1 for e in details.get("history", []) if e.get("event") == "rollback")
    return Group(t, Text(f"promotions {prom}, rollbacks {rb}, fits {len(details.get('history', []))}; traffic: "
                         f"{details.get('answered')} answered ({details.get('cheap_answers')} cheap, explore "
                         f"{details['explore']:.0%}), {details.get('feedback')} graded, accuracy / top "
                         f"{float(details.get('traffic_accuracy_ratio') or 0):.3f}; start-up "
                         f"{details.get('startup_s')} s, wall {details['wall_s']} s"))


def plot(report: dict[str, Any], path: Path, step0: dict[str, Any] | None = None) -> list[str]:
    """PNG: served savings vs requests (from the default before any traffic, ``step0`` of the details, when
    given), the offline fit and length as horizontal lines (one line when they are equal). Returns the legend's
    labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps = ([{"requests": 0, "served": step0["served"]}] if step0 is not None else []) + list(report["steps"])
    xs = [s["requests"] for s in steps]
    ys = [s["served"]["savings"] for s in steps]
    ax.plot(xs, ys, marker="o", label="gateway's own router (served; 0 = the default before any traffic)",
            zorder=4)
    for x, s in zip(xs, steps, strict=True):
        if not s["served"]["holds_floor"]:
            ax.scatter([x], [s["served"]["savings"]], color="red", zorder=3)
    off, length = report["offline_fit"]["savings"], report["length"]["savings"]
    if abs(off - length) < 1e-9:  # one line, named for both: drawn twice, the second hid the first
        ax.axhline(off, color="green", ls="--", label=f"offline fit = prompt length (calibrated): {off:.1%}")
    else:
        ax.axhline(off, color="green", ls="--", label=f"offline fit (all non-held-out): {off:.1%}")
        ax.axhline(length, color="gray", ls=":", label=f"prompt length (calibrated): {length:.1%}")
    ax.set_xlabel("requests of traffic")
    ax.set_ylabel("savings (1 - tokens / always-top), held-out")
    ax.set_title(f"{report['dataset']} {report['ladder']}, feedback {report['feedback_rate']:.0%} "
                 "(red: floor not held)", fontsize=9)
    ax.grid(alpha=0.3)
    labels = [t.get_text() for t in ax.legend(fontsize=8).get_texts()]
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return labels


def learn(
    traces_dir: Path = typer.Option(..., "--traces", help="Traces folder: DIR/<dataset>/<MODEL>__<SETTING>.jsonl.gz."),
    dataset: str = typer.Option(..., "--dataset", help="Data set folder under --traces (frames, simpleqa)."),
    ladder: str = typer.Option(..., "--ladder", help="MODEL:CHEAP,TOP (two settings, cheapest first)."),
    feedback_rate: float = typer.Option(0.25, "--feedback-rate", min=0, max=1, help="Share of answers graded."),
    steps: str = typer.Option("100,200,400,800", "--steps", help="Request counts at which to measure."),
    json_path: Path | None = typer.Option(
        None, "--json", help="Write the report as JSON here: {dataset, ladder, feedback_rate, steps: [{requests, "
                             "outcomes, router_version, served: {accuracy_ratio, token_share, savings, holds_floor}, "
                             "shadow_cost_usd}], offline_fit, length}."),
    png_path: Path | None = typer.Option(None, "--png", help="Write the learning-curve PNG here."),
    details_path: Path | None = typer.Option(None, "--details", help="Write the run details as JSON here "
                                                                    "(with the retraining's audit events: history)."),
    every_outcomes: int = typer.Option(25, "--every-outcomes", min=1, help="routing.retrain.every_outcomes."),
    explore: float = typer.Option(0.5, "--explore", min=0, max=1, help="routing.retrain.explore."),
    spot_check: float = typer.Option(0.05, "--spot-check", min=0, max=1,
                                     help="routing.retrain.spot_check (traffic replica)."),
    shadow: float = typer.Option(1.0, "--shadow", min=0, max=1, help="routing.shadow.fraction."),
    judge: str = typer.Option("normalised", "--judge", help="routing.shadow.judge (agreement, normalised)."),
    concurrency: int = typer.Option(4, min=1, max=32, help="Requests in flight."),
    seed: int = typer.Option(0, help="Traffic order and feedback sample."),
    time_budget_s: float = typer.Option(540.0, min=10, help="Whole-run budget (s); later steps are skipped."),
    config: Path | None = typer.Option(None, "--config", "-c", help="Base YAML config (default: $THINKGATE_CONFIG)."),
) -> None:
    """The gateway's own router learning from traffic and feedback, measured served on held-out questions."""
    import os

    from gateway.cli.common import load_settings
    from router.console import console

    try:
        step_t = tuple(int(s) for s in steps.split(",") if s.strip())
    except ValueError:
        typer.echo("thinkgate: bench learn: --steps: comma-separated integers", err=True)
        raise typer.Exit(2) from None
    cfg = Config(traces_dir, dataset, ladder, feedback_rate, step_t, every_outcomes, explore, shadow, judge,
                 concurrency, seed, time_budget_s, progress=os.environ.get("TG_NO_PROGRESS") is None,
                 spot_check=spot_check)
    try:
        report, details = run(cfg, load_settings(config))
    except (LearnBenchError, RuntimeError) as exc:
        typer.echo(f"thinkgate: bench learn: {exc}", err=True)
        raise typer.Exit(2) from None
    console().print(render(report, details))
    for path, text in ((json_path, json.dumps(report, indent=1)), (details_path, json.dumps(details, indent=1))):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if png_path:
        png_path.parent.mkdir(parents=True, exist_ok=True)
        plot(report, png_path, details.get("step0"))
    if not details["complete"]:
        raise typer.Exit(1)
