"""Closed-loop routing bench: a router fitted on one data set meets another's traffic.

``python -m bench.closed_loop [--traces DIR] [--ladder gemini-2.5-flash:no_think,budget1024] [--fit-on simpleqa]
[--stream frames] [--target 0.5] [--out bench/results/closed_loop.json] [--png ...] [--results]``

What runs (all on loopback, bounded: ~1–2 minutes on 2 cores):

(a) **Controller.** The router is fitted on ``--fit-on`` (``router.fit.ladder_fit.fit_ladder_router``, policy
    ``router``). ``--stream``'s questions (several shuffled passes) are scored by it and routed, once with the
    fixed thresholds and once with the gateway's cost-target controller (``gateway.control.target.
    TargetController`` — the same class the gateway runs, on the real Redis, update every 16 requests, window
    500, step bound 0.02, the config's default feedback gain 2 on the last 250 decisions' realized share) aiming
    at ``--target`` long share. The realized long share per 100-request block; per target, the worst
    500-request block after 300 requests of warm-up, also for the exact ``1 - target`` quantile of the stream's
    own scores (an oracle fixed cut: the sampling noise of the blocks alone) and for the plain quantile rule
    (``gain`` 0, the controller before the feedback term).
(b) **Retraining from shadow outcomes.** The first ``--stream`` passes are "served": each cheap-routed request
    is shadowed with probability 5 % / 20 %; the outcome is the serving judge (``gateway.control.shadow.
    answers_agree`` on the two recorded answers); ``router.fit.retrain.retrain`` (the code behind ``thinkgate
    router retrain --from-outcomes``) fits on them. ``savings_at_98`` (``router.fit.ladder_eval``) of the old and
    the retrained router on the stream set's held-out questions (``router.fit.traces.is_heldout``; never shadowed),
    with the shadow calls' cost (recorded top-setting completion tokens of the shadowed requests).
(c) **Drift.** PSI (``gateway.control.drift.psi``) of the last 300 scores against the router's score histogram on
    its own fit set, per block: a block of ``--fit-on`` traffic first, then ``--stream``'s.
(d) **Gateway latency, shadowing on vs off.** A real gateway (uvicorn) over two simulator upstreams, the shadow
    tier's answering 200 ms late: client p50/p99 of 300 sequential requests with ``routing.shadow.fraction`` 0,
    0.2 and 1.0.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import typer

from bench.router_traces import DEFAULT_TRACES  # ../shared/data/traces beside the checkout
from gateway.config import RedisConfig, RoutingConfig
from gateway.control.drift import psi
from gateway.control.shadow import answers_agree
from gateway.control.target import TargetController
from gateway.state.breaker import Breaker
from gateway.state.redis import connect
from router.fit.labels import LabelledItem
from router.fit.ladder_eval import savings_at_98, threshold_curve
from router.fit.ladder_fit import fit_ladder_router
from router.fit.retrain import RetrainRefused, retrain, score_histogram
from router.fit.traces import is_heldout, load_ladder, parse_ladder

BLOCK = 100
EVAL_BLOCK = 500
REDIS_URL = "redis://127.0.0.1:6379/0"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def controlled_shares(scores: np.ndarray, target: float, base: float, redis_url: str,
                            gain: float | None = None) -> list[int]:
    """Route ``scores`` in order with the controller (its own Redis prefix; ``gain`` None: the config's
    default); the tier index of each."""
    prefix = f"bench:cl:{uuid.uuid4().hex[:8]}:"
    extra = {} if gain is None else {"gain": gain}
    cfg = RoutingConfig(router_path=None, routed_tiers=["cheap", "top"], thresholds=[base],
                        target={"long_share": target, "window": 500, "min_samples": 50, "max_step": 0.02,
                                "update_every": 10**9, **extra})
    handle = connect(RedisConfig(url=redis_url, key_prefix=prefix))
    ctrl = TargetController(cfg, handle, Breaker(5.0), [base])
    tiers = []
    try:
        for j, s in enumerate(scores):
            k = int(s >= ctrl.thresholds([base])[-1])
            tiers.append(k)
            ctrl.record(float(s), k)
            if (j + 1) % 16 == 0:
                await ctrl.update()
    finally:
        await handle.client.delete(*ctrl.keys)
        await handle.close()
    return tiers


def gateway_shares(router: Any, cut: float, traces: Path, stream: str, lad: Any, questions: list[str],
                   target: float, more: dict[float, float] | None = None) -> dict[str, list[int]]:
    """(a) through the real gateway: the trace-replay upstream serving ``stream``'s recorded answers, two
    ``thinkgate serve`` processes with the router file (fixed ``cut``; the second with ``routing.target.
    long_share``), ``questions`` sent in order to each; the routed tier index of every request. ``more``
    (target → its fixed cut): one more controller gateway per target, keyed ``controller:{target}``."""
    import secrets
    import tempfile

    import httpx

    from bench._lib.redis_keys import delete_prefix
    from bench.savings_stack import serve_gateway
    from bench.traces.bench import gateway_config, tier_configs
    from bench.traces.prices import price_of
    from bench.traces.replay_upstream import ReplayProcess
    from gateway.config import Settings
    from router.persistence import save_router

    out: dict[str, list[int]] = {}
    secret = "tg-" + secrets.token_hex(16)
    keys = [{"id": "closed-loop", "secret": secret, "tags": {"bench": "closed-loop"}}]
    base = Settings.load(None)
    with tempfile.TemporaryDirectory(prefix="tg-closed-loop-") as tmp, \
            ReplayProcess(traces, stream, [(lad.model, s) for s in lad.settings]) as replay:
        state = Path(tmp)
        tiers = tier_configs(lad.model, lad.settings, replay.base_url, price_of(lad.model), False)
        names = list(lad.settings)
        runs = [("fixed", target, cut), ("controller", target, cut),
                *((f"controller:{t}", t, c) for t, c in (more or {}).items())]
        for mode, tgt, cut_m in runs:
            router.thresholds = [cut_m]
            path = save_router(router, state / f"router-{len(out)}.skops")
            prefix = f"bench:cl:{uuid.uuid4().hex[:8]}:"
            cfg = gateway_config(base, tiers, path, keys, prefix, state, mode.replace(":", "-"))
            cfg["routing"]["drift"] = {"enabled": False}
            if mode != "fixed":
                cfg["routing"]["target"] = {"long_share": tgt, "window": 500, "max_step": 0.02,
                                            "update_every": 16, "min_samples": 50}
            try:
                with serve_gateway(cfg, state, mode.replace(":", "-")) as url, \
                        httpx.Client(timeout=60, headers={"authorization": f"Bearer {secret}"}) as client:
                    tiers_seen = []
                    for q in questions:
                        r = client.post(url + "/v1/chat/completions", json={
                            "model": "auto", "messages": [{"role": "user", "content": q}]})
                        r.raise_for_status()
                        tiers_seen.append(names.index(r.headers["x-thinkgate-tier"]))
                    out[mode] = tiers_seen
            finally:
                delete_prefix(REDIS_URL, prefix)
    return out


def worst_block(tiers: np.ndarray, target: float) -> float:
    """The largest |share − target| over consecutive ``EVAL_BLOCK``-request blocks of ``tiers``."""
    return max(abs(float(tiers[i:i + EVAL_BLOCK].mean()) - target)
               for i in range(0, len(tiers) - EVAL_BLOCK + 1, EVAL_BLOCK))


def blocks(tiers: list[int] | np.ndarray) -> list[float]:
    t = np.asarray(tiers)
    return [float(t[i:i + BLOCK].mean()) for i in range(0, len(t) - BLOCK + 1, BLOCK)]


def shadow_retrain(router: Any, data: Any, scores: np.ndarray, fraction: float, passes: int, seed: int,
                   dataset: str, cut: float, base: list[LabelledItem]) -> dict[str, Any]:
    """Serve the non-held-out questions ``passes`` times at ``cut`` (the controller's threshold), shadow
    ``fraction`` of the cheap-routed ones, retrain on their outcomes plus the ``base`` (offline) labels."""
    rng = np.random.default_rng(seed)
    idx = [i for i, q in enumerate(data.ids) if not is_heldout(dataset, q)]
    outcomes: dict[int, list[int]] = {}
    shadow_tokens = 0.0
    n_shadow = 0
    for _ in range(passes):
        for i in rng.permutation(idx):
            if scores[i] >= cut or rng.random() >= fraction:
                continue
            n_shadow += 1
            shadow_tokens += float(data.tokens[i, -1])
            agree = answers_agree(data.responses[i][0], data.responses[i][-1])
            outcomes.setdefault(int(i), []).append(0 if agree else 1)
    items = [LabelledItem(id=data.ids[i], text=data.questions[i], label=int(np.mean(v) >= 0.5), source="outcomes",
                          group=data.ids[i]) for i, v in outcomes.items()]
    res: dict[str, Any] = {"fraction": fraction, "shadow_calls": n_shadow, "labelled_questions": len(items),
                           "shadow_completion_tokens": shadow_tokens}
    try:
        new, report = retrain(router, items, base, long_share=None, heldout_frac=0.2, min_heldout=5)
        res.update(accepted=True, old_auc=report.old.auc, new_auc=report.new.auc, router=new)
    except (RetrainRefused, ValueError) as exc:
        res.update(accepted=False, reason=str(exc), router=None)
    return res


def heldout_savings(router: Any, data: Any, dataset: str) -> float:
    held = np.array([is_heldout(dataset, q) for q in data.ids])
    scores = np.array([router.score(q) for q in np.asarray(data.questions, dtype=object)[held]])
    correct, tokens = data.correct[held], data.tokens[held]
    curve = threshold_curve(scores, correct, tokens)
    return float(savings_at_98(curve, float(correct[:, -1].mean())))


def gateway_latency(n: int = 300) -> dict[str, dict[str, float]]:
    """Client latency p50/p99 (ms) through a real gateway: the whole loop off (no outcomes, no drift alarm), then
    the defaults with shadow fraction 0 / 0.2 / 1.0."""
    import httpx

    from tests.fixtures.gateway import SECRETS, accounting_gateway, cleanup
    from tests.fixtures.upstream import sim_tiers, start_sim

    fast, slow = start_sim(), start_sim("--delay-ms", "200")
    out: dict[str, dict[str, float]] = {}
    tmp = Path("/tmp") / f"closed-loop-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        tiers = sim_tiers(fast.base_url)
        tiers[2]["base_url"] = slow.base_url
        for name, fraction in (("loop off", 0.0), ("0", 0.0), ("0.2", 0.2), ("1", 1.0)):
            prefix = f"bench:cl:{uuid.uuid4().hex[:8]}:"
            routing: dict[str, Any] = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.9],
                                       "shadow": {"fraction": fraction, "max_concurrency": 16}}
            if name == "loop off":
                routing.update(outcomes={"enabled": False}, drift={"enabled": False})
            with accounting_gateway(fast.base_url, REDIS_URL, tmp, prefix=prefix, tiers=tiers, routing=routing) as gw, \
                    httpx.Client(timeout=30, headers={"authorization": f"Bearer {SECRETS['alice']}"}) as client:
                lat = []
                for i in range(n):
                    t0 = time.perf_counter()
                    r = client.post(gw.base_url + "/chat/completions", json={
                        "model": "auto", "max_tokens": 16, "messages": [{"role": "user", "content": f"q {i} of {n}"}]})
                    lat.append((time.perf_counter() - t0) * 1000)
                    assert r.status_code == 200
                shadow = gw.app.state.proxy.shadow
                lat.sort()
                out[name] = {"p50_ms": statistics.median(lat), "p99_ms": lat[int(0.99 * (n - 1))],
                                        "shadowed": shadow.stats.started if shadow else 0}
            cleanup(REDIS_URL, prefix)
    finally:
        fast.stop()
        slow.stop()
    return out


def main(
    traces: Path = typer.Option(DEFAULT_TRACES, help="traces folder"),
    ladder: str = typer.Option("gemini-2.5-flash:no_think,budget1024", help="two-setting ladder"),
    fit_on: str = typer.Option("simpleqa", help="data set the router is fitted on"),
    stream: str = typer.Option("frames", help="data set whose traffic it then serves"),
    target: float = typer.Option(0.5, help="routing.target.long_share (the over-time table and PNG)"),
    more_targets: str = typer.Option("0.2,0.35,0.65,0.8", help="other targets for the summary table"),
    passes: int = typer.Option(6, help="passes over the stream's questions"),
    out: Path = typer.Option(Path("bench/results/closed_loop.json"), help="JSON to write"),
    png: Path | None = typer.Option(Path("bench/results/closed_loop.png"), help="PNG over time"),
    latency: bool = typer.Option(True, help="also measure the gateway's latency with shadowing on vs off"),
    gateway: bool = typer.Option(True, help="also run (a) through the real gateway on the trace replay"),
    gateway_all_targets: bool = typer.Option(True, help="through the gateway also at every --more-targets"),
    results: bool = typer.Option(True, help="rewrite the '## Closed loop' section of bench/RESULTS.md"),
) -> None:
    t_start = time.perf_counter()
    lad = parse_ladder(ladder)
    _log(f"fitting a router on {fit_on} {ladder} …")
    fit = fit_ladder_router(traces, [fit_on], lad, policy="router")
    router = fit.router
    base_cut = router.thresholds[-1]
    src = load_ladder(traces, fit_on, lad)
    dst = load_ladder(traces, stream, lad)
    src_scores = np.array([router.score(q) for q in src.questions])
    dst_scores = np.array([router.score(q) for q in dst.questions])
    rng = np.random.default_rng(0)
    order = np.concatenate([rng.permutation(len(dst.questions)) for _ in range(passes)])
    stream_scores = dst_scores[order]
    # fixed thresholds calibrated to the target share on the fit set (what `router calibrate` does offline)
    fixed_cut = float(np.quantile(src_scores, 1 - target))
    fixed = (stream_scores >= fixed_cut).astype(int)
    ctrl = asyncio.run(controlled_shares(stream_scores, target, fixed_cut, REDIS_URL))
    summary = []
    for tgt in [target, *(float(x) for x in more_targets.split(",") if x)]:
        cut_t = float(np.quantile(src_scores, 1 - tgt))
        fixed_t = (stream_scores >= cut_t).astype(int)
        ctrl_t = np.asarray(asyncio.run(controlled_shares(stream_scores, tgt, cut_t, REDIS_URL)))[300:]
        plain_t = np.asarray(asyncio.run(controlled_shares(stream_scores, tgt, cut_t, REDIS_URL, gain=0.0)))[300:]
        oracle_t = (stream_scores >= float(np.quantile(dst_scores, 1 - tgt))).astype(int)[300:]
        summary.append({"target": tgt, "fixed": float(fixed_t.mean()),
                        "fixed_after_warmup": float(fixed_t[300:].mean()),
                        "controlled_after_warmup": float(ctrl_t.mean()),
                        "worst_500_block_error": worst_block(ctrl_t, tgt),
                        "worst_500_block_error_plain_quantile": worst_block(plain_t, tgt),
                        "worst_500_block_error_oracle_cut": worst_block(oracle_t, tgt)})
    fixed_b, ctrl_b = blocks(fixed), blocks(ctrl)
    warm = 3  # blocks of warm-up (300 requests)
    after = np.asarray(ctrl[warm * BLOCK:])
    eval_blocks = [float(after[i:i + EVAL_BLOCK].mean()) for i in range(0, len(after) - EVAL_BLOCK + 1, EVAL_BLOCK)]
    worst_ctrl = max(abs(b - target) for b in eval_blocks)
    # the controller's threshold on this traffic (the cut the closed loop serves at): the target quantile
    served_cut = float(np.quantile(dst_scores, 1 - target))
    # the share fixed thresholds were calibrated to: the fit set's share at the calibrated cut
    src_share = float(np.mean(src_scores >= base_cut))
    # (c) drift: a block of fit-set traffic, then the stream
    ref = score_histogram(src_scores)
    drift_stream = np.concatenate([src_scores[rng.permutation(len(src_scores))][:300], stream_scores[:1200]])
    edges = np.asarray(ref["edges"])
    drift_psi = [psi(np.histogram(drift_stream[max(0, i - 300):i], bins=edges)[0], ref["counts"])
                 for i in range(BLOCK, len(drift_stream) + 1, BLOCK)]
    # (b) retraining from shadow outcomes
    old_sav = heldout_savings(router, dst, stream)
    # the offline labels (`--base-labels`): the fit set's own sufficing labels (1 = only the top setting answers)
    from router.fit.traces import sufficing_labels
    suff = sufficing_labels(src.correct)
    base_items = [LabelledItem(id=f"{fit_on}/{q}", text=t, label=int(k == 1), source=fit_on, group=q)
                  for q, t, k in zip(src.ids, src.questions, suff, strict=True)]
    retrains = []
    for fraction in (0.05, 0.2):
        r = shadow_retrain(router, dst, dst_scores, fraction, passes, 1, stream, served_cut, base_items)
        r["savings_at_98_old"] = old_sav
        r["savings_at_98_new"] = heldout_savings(r["router"], dst, stream) if r["router"] is not None else None
        r.pop("router")
        retrains.append(r)
    lat = gateway_latency() if latency else {}
    through: dict[str, Any] = {}
    if gateway:
        _log("(a) through the real gateway on the trace replay …")
        t_gw = time.perf_counter()
        more_cuts = {t["target"]: float(np.quantile(src_scores, 1 - t["target"])) for t in summary
                     if t["target"] != target} if gateway_all_targets else {}
        seen = gateway_shares(router, fixed_cut, traces, stream, lad, [dst.questions[i] for i in order], target,
                              more_cuts)
        for t in summary:
            key = "controller" if t["target"] == target else f"controller:{t['target']}"
            if key in seen:
                t["gateway_worst_500_block_error"] = worst_block(np.asarray(seen[key][warm * BLOCK:]), t["target"])
                t["gateway_after_warmup"] = float(np.mean(seen[key][warm * BLOCK:]))
        after_gw = np.asarray(seen["controller"][warm * BLOCK:])
        b500 = [float(after_gw[i:i + EVAL_BLOCK].mean()) for i in range(0, len(after_gw) - EVAL_BLOCK + 1,
                                                                           EVAL_BLOCK)]
        through = {"fixed_blocks": blocks(seen["fixed"]), "controlled_blocks": blocks(seen["controller"]),
                   "fixed_mean": float(np.mean(seen["fixed"])), "controlled_after_warmup": float(after_gw.mean()),
                   "blocks_500_after_warmup": b500,
                   "worst_block_error_after_warmup": max(abs(b - target) for b in b500),
                   "seconds": round(time.perf_counter() - t_gw, 1)}
    report = {
        "ran_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ladder": ladder, "fit_on": fit_on,
        "stream": stream, "target": target, "requests": len(order), "calibrated_cut": base_cut,
        "fit_set_long_share": src_share, "fixed_cut": fixed_cut,
        "quality_cut_share_on_stream": float(np.mean(stream_scores >= base_cut)),
        "controller": {"fixed_blocks": fixed_b, "controlled_blocks": ctrl_b, "warmup_requests": warm * BLOCK,
                       "fixed_mean": float(np.mean(fixed)),
                       "controlled_after_warmup": float(np.mean(ctrl[warm * BLOCK:])),
                       "blocks_500_after_warmup": eval_blocks, "worst_block_error_after_warmup": worst_ctrl},
        "targets": summary, "drift_psi_blocks": drift_psi, "drift_switch_block": 3,
        "retrain": retrains, "latency": lat, "through_gateway": through,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    md = markdown(report)
    print(md)
    if png is not None:
        plot(report, png)
    if results:
        from bench._lib.results_md import write_section

        write_section("## Closed loop", "## Closed loop\n\n`python -m bench.closed_loop` (this machine: 2 shared "
                      "cores, no GPU, Python 3.11; real Redis on loopback; what each part runs: the script's "
                      "docstring). JSON: `bench/results/closed_loop.json`.\n\n" + md
                      + ("\n\n![closed loop](results/closed_loop.png)" if png is not None else "") + "\n")
    _log(f"wrote {out}{' and ' + str(png) if png else ''} in {report['seconds']} s")


def markdown(r: dict[str, Any]) -> str:
    c = r["controller"]
    lines = [f"Router fitted on {r['fit_on']} ({r['ladder']}, calibrated cut {r['calibrated_cut']:.3f}, long share "
             f"{r['fit_set_long_share']:.1%} there, {r['quality_cut_share_on_stream']:.1%} on the stream), serving "
             f"{r['stream']} traffic ({r['requests']} requests); target long share {r['target']:.0%}. Fixed "
             f"thresholds: calibrated to the target on {r['fit_on']} (cut {r['fixed_cut']:.3f}); the controller "
             f"starts from that cut. Ran {r['ran_utc']}, {r['seconds']} s.", "",
             "| requests | fixed thresholds | controller |", "|---:|---:|---:|"]
    for i, (f, k) in enumerate(zip(c["fixed_blocks"], c["controlled_blocks"], strict=True)):
        if i < 6 or i % 5 == 0 or i == len(c["fixed_blocks"]) - 1:
            lines.append(f"| {(i + 1) * BLOCK} | {f:.1%} | {k:.1%} |")
    lines += ["", f"Fixed: {c['fixed_mean']:.1%} overall. Controller after {c['warmup_requests']} requests: "
              f"{c['controlled_after_warmup']:.1%}; per 500 requests "
              + ", ".join(f"{b:.1%}" for b in c["blocks_500_after_warmup"])
              + f" — worst {c['worst_block_error_after_warmup']:.1%} from the target (±3 points asked: "
              f"{'met' if c['worst_block_error_after_warmup'] <= 0.03 else 'not met'}; the sampling noise of a "
              "500-request block alone is ±1.8 points at 20 %, ±2.2 at 50 %).", "",
              "Worst 500-request block after the warm-up, per target: the controller (quantile + feedback gain 2 on "
              "the last 250 decisions' realized share, the default), the plain quantile rule (gain 0), and an "
              "oracle fixed cut at the exact quantile of the stream's own scores (what block sampling noise alone "
              "gives).", "",
              "| target | fixed (calibrated on the fit set) | controller after 300 | worst 500-block error | ±3 | "
              "plain quantile worst | oracle cut worst | through the gateway: after 300, worst block, ±3 |",
              "|---:|---:|---:|---:|---|---:|---:|---|"]
    for t in r["targets"]:
        ok = "met" if t["worst_500_block_error"] <= 0.03 else "not met"
        lines.append(f"| {t['target']:.0%} | {t['fixed_after_warmup']:.1%} | {t['controlled_after_warmup']:.1%} | "
                     f"{t['worst_500_block_error']:.1%} | {ok} | "
                     f"{t.get('worst_500_block_error_plain_quantile', float('nan')):.1%} | "
                     f"{t.get('worst_500_block_error_oracle_cut', float('nan')):.1%} | {_gw_cell(t)} |")
    g = r.get("through_gateway") or {}
    if g:
        lines += ["", "Through the real gateway (two `thinkgate serve` processes, fixed vs "
                  f"`routing.target.long_share: {r['target']}`, on the trace-replay upstream serving {r['stream']}'s "
                  "recorded answers, same "
                  f"{r['requests']} requests in the same order, {g['seconds']} s): fixed {g['fixed_mean']:.1%}; "
                  f"controller after 300 requests {g['controlled_after_warmup']:.1%}, per 500 requests "
                  + ", ".join(f"{b:.1%}" for b in g["blocks_500_after_warmup"])
                  + f" — worst {g['worst_block_error_after_warmup']:.1%} from the target. The table's last "
                  "column: one more gateway per target, `routing.target.long_share` set to it."]
    lines += ["",
              "| shadow fraction | shadow calls | their completion tokens | labelled | retrain | "
              "savings_at_98 old → new (held-out) |", "|---:|---:|---:|---:|---|---|"]
    for t in r["retrain"]:
        verdict = (f"accepted (AUC {t['old_auc']:.3f} → {t['new_auc']:.3f})" if t["accepted"]
                   else f"refused: {t['reason'][:80]}")
        new = f"{t['savings_at_98_new']:.1%}" if t["savings_at_98_new"] is not None else "—"
        lines.append(f"| {t['fraction']:.0%} | {t['shadow_calls']} | {t['shadow_completion_tokens']:.0f} | "
                     f"{t['labelled_questions']} | {verdict} | {t['savings_at_98_old']:.1%} → {new} |")
    lines += ["", "Drift PSI (last 300 scores vs the fit set's histogram), per 100 requests; the stream starts after "
              "300: " + ", ".join(f"{p:.2f}" for p in r["drift_psi_blocks"])]
    if r["latency"]:
        lines += ["", "Client latency through a real gateway (300 sequential requests, simulator upstreams, the shadow "
                  "tier 200 ms slow; `loop off` = `routing.outcomes.enabled: false`, `routing.drift.enabled: false`):",
                  "", "| shadow fraction | p50 ms | p99 ms | shadowed |", "|---:|---:|---:|---:|"]
        for k, v in r["latency"].items():
            lines.append(f"| {k} | {v['p50_ms']:.1f} | {v['p99_ms']:.1f} | {v['shadowed']} |")
    return "\n".join(lines)


def _gw_cell(t: dict[str, Any]) -> str:
    if "gateway_worst_500_block_error" not in t:
        return "—"
    ok = "met" if t["gateway_worst_500_block_error"] <= 0.03 else "not met"
    return f"{t['gateway_after_warmup']:.1%}, {t['gateway_worst_500_block_error']:.1%}, {ok}"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = r["controller"]
    x = [(i + 1) * BLOCK for i in range(len(c["fixed_blocks"]))]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(x, c["fixed_blocks"], label="fixed thresholds")
    a.plot(x, c["controlled_blocks"], label="controller")
    a.axhline(r["target"], color="k", ls="--", lw=1, label="target")
    a.fill_between(x, r["target"] - 0.03, r["target"] + 0.03, color="k", alpha=0.08)
    a.set_xlabel("requests")
    a.set_ylabel("long share (per 100 requests)")
    a.set_title(f"{r['fit_on']}-fitted router on {r['stream']} traffic")
    a.legend()
    px = [(i + 1) * BLOCK for i in range(len(r["drift_psi_blocks"]))]
    b.plot(px, r["drift_psi_blocks"], marker="o")
    b.axhline(0.25, color="r", ls="--", lw=1, label="alarm (0.25)")
    b.axvline(300, color="k", ls=":", lw=1, label=f"{r['stream']} traffic starts")
    b.set_xlabel("requests")
    b.set_ylabel("PSI of the router scores")
    b.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    typer.run(main)
