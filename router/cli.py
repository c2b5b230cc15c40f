"""`thinkgate router …` commands: label, fit, calibrate, eval, info, score, build-default, cold-start.

Heavy imports (scikit-learn, skops, matplotlib) happen inside the commands so ``thinkgate --help`` is fast.
Data flow::

    label difficulty|outcomes|gateway  →  labelled JSONL  →  fit  →  calibrate  →  eval   (→ gateway)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(no_args_is_help=True)
label_app = typer.Typer(no_args_is_help=True, help="Make labelled JSONL (text, label, outcomes) from three sources.")
app.add_typer(label_app, name="label")

_DEFAULT_ROUTER = Path(__file__).resolve().parent / "assets" / "default.skops"
#: the learned default candidate (``build-default`` writes it; ``cold-start`` decides whether it is served)
_LEARNED_ROUTER = Path(__file__).resolve().parent / "assets" / "default-learned.skops"


def _console() -> Any:
    from router.console import console

    return console(width=200)  # on a terminal too: the fit and eval tables are wider than most


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _load(path: Path) -> Any:
    from router.persistence import RouterFileError, load_router

    try:
        return load_router(path)
    except RouterFileError as exc:
        _fail(str(exc))


def _check_output(path: Path | None, flag: str, *, folder: bool = False) -> None:
    """Fail (exit 2, one line naming ``flag``) when ``path`` cannot be written — before the work that fills it
    (:func:`router.fit.outputs.output_problem`); None passes."""
    from router.fit.outputs import output_problem

    why = output_problem(path, folder=folder) if path is not None else None
    if why:
        _fail(f"{flag}: {why}")


def _check_range(flag: str, value: float, lo: float, hi: float, *, hi_ok: bool = False) -> None:
    """Fail (exit 2, one line naming ``flag``) unless ``lo < value < hi`` (``value <= hi`` with ``hi_ok``): a
    share of always-top accuracy above 1, a confidence of 100% or a split of more than everything fits nothing
    meaningful — or fails deep inside the fit."""
    if not (lo < value < hi or (hi_ok and value == hi)):
        _fail(f"{flag} must be in ({lo:g}, {hi:g}{']' if hi_ok else ')'}, got {value:g}")


def _save(save: Any, router: Any, dest: Path) -> Path:
    """``save(router, dest)`` (:func:`router.persistence.save_router`), a write failure the up-front check could
    not foresee (a full disk) as one line, exit 2."""
    try:
        return Path(save(router, dest))
    except OSError as exc:
        _fail(f"cannot write {dest}: {exc.strerror or exc}")
        raise AssertionError from None  # unreachable


def _items(paths: list[Path], *, at_least: int = 0) -> list[Any]:
    """The labelled items of ``paths``; fails (exit 2, one line) on an unreadable file or fewer than ``at_least``
    items (``calibrate``/``eval``: :data:`router.fit.labels.MIN_LABELLED_ITEMS`, as ``fit`` needs)."""
    from router.fit.labels import load_items

    try:
        items = load_items(paths)
    except (OSError, ValueError) as exc:
        _fail(str(exc))
        raise  # unreachable
    if len(items) < at_least:
        _fail(f"need at least {at_least} labelled items, got {len(items)} in {', '.join(map(str, paths))}")
    return items


# ---- label ---------------------------------------------------------------------------------------------------


@label_app.command("difficulty")
def label_difficulty(
    inp: Annotated[Path, typer.Argument(help="JSONL(.gz) with a text and a numeric difficulty field")],
    out: Annotated[Path, typer.Argument(help="labelled JSONL to write")],
    threshold: Annotated[float, typer.Option(help="difficulty >= threshold → label 1 (long)")] = 4,
    text_field: str = "problem",
    difficulty_field: str = "level",
    group_field: str = "subject",
    id_field: str = "unique_id",
    source: Annotated[str, typer.Option(help="source name (suffixed with >=threshold)")] = "math-level",
) -> None:
    """Source 1: a data set's own difficulty (MATH `level`, the arithmetic task's #operations)."""
    from router.fit.jsonl import read_jsonl, write_jsonl
    from router.fit.labels import from_difficulty

    rows = from_difficulty(read_jsonl(inp), threshold=threshold, text_field=text_field,
                           difficulty_field=difficulty_field, group_field=group_field or None,
                           id_field=id_field or None, source=source)
    n = write_jsonl(out, (it.to_dict() for it in rows))
    typer.echo(f"wrote {n} labelled items to {out}")


@label_app.command("outcomes")
def label_outcomes(
    inp: Annotated[Path, typer.Argument(help="JSONL(.gz) with weak/strong correctness columns")],
    out: Annotated[Path, typer.Argument(help="labelled JSONL to write")],
    weak_field: str = "mistralai/Mixtral-8x7B-Instruct-v0.1",
    strong_field: str = "gpt-4-1106-preview",
    text_field: str = "prompt",
    group_field: str = "subject",
    id_field: Annotated[str, typer.Option(help="id column ('' = row number)")] = "",
    source: str = "routellm-mmlu",
) -> None:
    """Source 2: outcome pairs — weak wrong and strong right → long (RouteLLM's MMLU file by default)."""
    from router.fit.jsonl import read_jsonl, write_jsonl
    from router.fit.labels import from_outcome_pairs

    rows = from_outcome_pairs(read_jsonl(inp), weak_field=weak_field, strong_field=strong_field,
                              text_field=text_field, group_field=group_field or None, id_field=id_field or None,
                              source=source, id_prefix=f"{source}/")
    n = write_jsonl(out, (it.to_dict() for it in rows))
    typer.echo(f"wrote {n} labelled items to {out}")


@label_app.command("gateway")
def label_gateway(
    inp: Annotated[Path, typer.Argument(help="JSONL of {id, question, answer[, task, system, group]}")],
    out: Annotated[Path, typer.Argument(help="labelled JSONL (appended; ids already there are skipped)")],
    tiers: Annotated[str, typer.Option(help="comma-separated tier names, cheapest first")] = "short,long",
    verifier: Annotated[str, typer.Option(help="task | math | int | exact | module:function")] = "task",
    concurrency: int = 4,
    limit: Annotated[int | None, typer.Option(help="label at most this many new items")] = None,
    url: Annotated[str | None, typer.Option(help="server base URL (default $THINKGATE_URL)")] = None,
    api_key: Annotated[str | None, typer.Option(help="API key (default $THINKGATE_API_KEY)")] = None,
    timeout_s: float = 300.0,
    source: str = "gateway",
) -> None:
    """Source 3: measure each tier's correctness and tokens through a running gateway (resumable)."""
    from router.fit.outcomes import label_via_gateway
    from router.probe import ProbeClient
    from router.tasks.verifiers import get_verifier

    try:
        check = get_verifier(verifier)
    except ValueError as exc:
        _fail(str(exc))
    tier_list = [t.strip() for t in tiers.split(",") if t.strip()]
    client = ProbeClient.from_env(url, api_key, require_key=False, timeout_s=timeout_s)
    try:
        stats = label_via_gateway(inp, out, tier_list, check, client=client, concurrency=concurrency,
                                  limit=limit, source=source)
    except ValueError as exc:
        _fail(str(exc))
    finally:
        client.close()
    typer.echo(f"{stats.written} written, {stats.skipped_existing} already done, {stats.failed} failed "
               f"(of {stats.total}) → {out}")
    for e in stats.errors[:5]:
        typer.echo(f"  failed: {e}", err=True)
    if stats.failed:
        raise typer.Exit(1)


@label_app.command("export-task")
def export_task(
    task: Annotated[str, typer.Argument(help="arith | gsm8k | math (router.tasks)")],
    split: Annotated[str, typer.Argument(help="train | test")],
    out: Annotated[Path, typer.Argument(help="JSONL of {id, question, answer, task, difficulty, group}")],
    n: Annotated[int | None, typer.Option(help="problems per difficulty level (arith) or in all")] = None,
    difficulties: Annotated[str, typer.Option(help="comma-separated levels (arith default 1-7)")] = "",
    seed: int = 0,
) -> None:
    """Write task problems as question rows: input to `label gateway` (and to `label difficulty` with
    --text-field question --difficulty-field difficulty)."""
    from router.fit.jsonl import write_jsonl
    from router.tasks.rows import task_rows

    levels = [int(x) for x in difficulties.split(",") if x.strip()] or None
    try:
        rows = task_rows(task, split, n, seed, levels)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        _fail(str(exc))
    typer.echo(f"wrote {write_jsonl(out, rows)} rows to {out}")


# ---- fit / calibrate / eval -----------------------------------------------------------------------------------


@app.command("fit")
def fit(
    data: Annotated[list[Path] | None, typer.Argument(help="labelled JSONL file(s) (not with --traces)")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "--output", "-o", help="router file to write (.skops); a folder for several --ladder")] = None,
    traces: Annotated[Path | None, typer.Option(help="traces folder DIR/<dataset>/<MODEL>__<SETTING>.jsonl.gz")] = None,
    dataset: Annotated[list[str] | None, typer.Option(help="trace data set(s) to fit on (with --traces)")] = None,
    ladder: Annotated[list[str] | None, typer.Option(
        help="MODEL:SETTING1,SETTING2[,SETTING3], cheapest first (with --traces; one router each)")] = None,
    quality_target: Annotated[float, typer.Option(help="thresholds keep >= this x always-top accuracy")] = 0.98,
    delta: Annotated[float, typer.Option(help="--traces: the floor may fail with at most this probability "
                                         "(Learn-then-Test, 1 - confidence)")] = 0.1,
    cal_frac: Annotated[float, typer.Option(help="--traces: share of the non-held-out questions kept to "
                                            "certify the thresholds")] = 0.5,
    heldout_frac: Annotated[float, typer.Option(help="fixed held-out share (sha256 of dataset/id)")] = 0.2,
    policy: Annotated[str, typer.Option(help="auto (fallback rule) | router | length | random")] = "auto",
    pool: Annotated[str, typer.Option(help="models (pool every model's outcomes per question) | none")] = "models",
    alpha: Annotated[float, typer.Option(help="ridge strength of the trace router")] = 2.0,
    feature_set: Annotated[str, typer.Option(help="hand features: base | qa (+ question structure)")] = "base",
    val_frac: Annotated[float, typer.Option(help="validation share per source, by group")] = 0.2,
    platt_frac: Annotated[float, typer.Option(help="share of the training part held out for Platt scaling")] = 0.15,
    refit: Annotated[bool, typer.Option(help="after validating, refit on all items (shipped models)")] = False,
    seed: int = 0,
    c: Annotated[float, typer.Option("--C", help="inverse L2 strength")] = 2.0,
    max_chars: int = 4000,
    word_max_features: int = 10_000,
    char_max_features: int = 15_000,
    min_df: int = 3,
    word_ngrams: Annotated[str, typer.Option(help="word n-gram range 'lo,hi'")] = "1,1",
    char_ngrams: Annotated[str, typer.Option(help="char n-gram range 'lo,hi'")] = "2,4",
) -> None:
    """Fit a router: from labelled JSONL files, or from recorded traces (--traces, --dataset, --ladder).

    With --traces: per ladder, the fixed held-out questions are set aside, a ridge router is fitted on the rest
    (5-fold bagged), the served thresholds are certified with cross-fitted scores to keep --quality-target of
    always-top accuracy with nominal confidence 1 - --delta (Learn-then-Test; approximate), and the file carries
    the whole served policy (scorer, thresholds, cascade or not, the guarantee; see docs/router.md).
    """
    if out is None:
        _fail("--output FILE is required")
        raise AssertionError  # unreachable
    _check_range("--quality-target", quality_target, 0.0, 1.0, hi_ok=True)
    _check_range("--delta", delta, 0.0, 1.0)
    _check_range("--cal-frac", cal_frac, 0.0, 1.0)
    _check_range("--heldout-frac", heldout_frac, 0.0, 1.0)
    # several ladders write a folder of files (checked again in _fit_traces: a suffix there is refused)
    _check_output(out, "--output", folder=traces is not None and len(ladder or []) > 1)
    if traces is not None:
        if data:
            _fail("give labelled files or --traces, not both")
        _fit_traces(traces, dataset or [], ladder or [], out, quality_target=quality_target,
                    heldout_frac=heldout_frac, policy=policy, pool=pool, alpha=alpha, seed=seed,
                    feature_set=feature_set, delta=delta, cal_frac=cal_frac)
        return
    if not data:
        _fail("give labelled JSONL file(s), or --traces DIR --dataset NAME --ladder MODEL:S1,S2")
        raise AssertionError  # unreachable
    from router.fit.evaluate import render_table
    from router.fit.fitter import fit_router
    from router.model import ModelConfig
    from router.persistence import save_router

    items = _items(data)
    try:
        wlo, whi = (int(x) for x in word_ngrams.split(","))
        clo, chi = (int(x) for x in char_ngrams.split(","))
    except ValueError:
        _fail("n-gram ranges are 'lo,hi', e.g. 1,2")
    cfg = ModelConfig(max_chars=max_chars, word_ngrams=(wlo, whi), char_ngrams=(clo, chi),
                      word_max_features=word_max_features, char_max_features=char_max_features, min_df=min_df,
                      C=c, seed=seed)
    try:
        router, report = fit_router(items, cfg, val_frac=val_frac, platt_frac=platt_frac, refit=refit,
                                    data_files=[str(p) for p in data])
    except ValueError as exc:
        _fail(str(exc))
    _save(save_router, router, out)
    con = _console()
    con.print(f"fit {report.n_fit} · platt {report.n_platt} · validation {report.n_val} items in "
              f"{report.fit_seconds:.1f} s{' (then refitted on all)' if report.refit else ''}")
    if report.validation:
        con.print(render_table(report.validation, title="Validation (held-out groups)"))
    con.print(f"saved {out} ({out.stat().st_size / 1e6:.2f} MB); next: thinkgate router calibrate {out} DATA")


def _fit_traces(traces: Path, datasets: list[str], ladders: list[str], out: Path, **kw: Any) -> None:
    from router.fit.ladder_fit import fit_ladder_router
    from router.fit.traces import parse_ladder
    from router.persistence import save_router

    if not datasets or not ladders:
        _fail("--traces needs at least one --dataset and one --ladder")
    try:
        parsed = [parse_ladder(spec) for spec in ladders]
    except ValueError as exc:
        _fail(str(exc))
        raise AssertionError from None  # unreachable
    if len(parsed) > 1 and out.suffix:
        _fail(f"several --ladder: --output must be a folder (one <MODEL>__<S1>-<S2>.skops each), got {out}")
    con = _console()
    for lad in parsed:
        dest = out if len(parsed) == 1 else out / f"{lad.slug}.skops"
        try:
            res = fit_ladder_router(traces, datasets, lad, quality_target=kw["quality_target"],
                                    heldout_frac=kw["heldout_frac"], policy=kw["policy"], pool=kw["pool"],
                                    alpha=kw["alpha"], seed=kw["seed"], feature_set=kw["feature_set"],
                                    delta=kw["delta"], cal_frac=kw["cal_frac"])
        except (OSError, ValueError) as exc:
            _fail(str(exc))
            raise AssertionError from None  # unreachable
        _save(save_router, res.router, dest)
        from router.policy import guarantee_sentence

        v = res.validation
        sav = "  ".join(f"{p} {100 * x:.1f}%" for p, x in v["savings_at_98"].items())
        sv = res.router.metadata["serving"]
        con.print(f"{lad.name} on {'+'.join(datasets)}: {v['n']} questions (held-out excluded), {res.seconds:.1f} s")
        ranks = sv.get("family_choice", {}).get("certified_savings_in_sample", {})
        basis = "  ".join(f"{f} {100 * x:.1f}%" for f, x in ranks.items())
        con.print(f"  fit-split savings_at_98 (curve metric, for reference): {sav}")
        con.print(f"  scorer [bold]{res.policy}[/bold], chosen by in-sample savings on the fit split (Learn-then-Test "
                  f"run on the fit split itself: a ranking, not a certificate): {basis}")
        for line in _serving_lines(sv):
            con.print(f"  {line}")
        con.print(f"  {guarantee_sentence(res.router.metadata)}")
        con.print(f"  saved {dest} ({dest.stat().st_size / 1e6:.2f} MB)")


def _serving_lines(sv: dict[str, Any]) -> list[str]:
    """What a trace router file serves and the split-family points it keeps beside it, each with its thresholds and
    what was certified for it. The alternatives are the chosen scorer alone and with the cascade, certified on the
    calibration split only (``bench traces`` serves them as its ``router`` and ``router+cascade`` rows); printed as
    "router alone [0.0], with the cascade [0.0]" next to the served cut, they read as cuts of the served policy and
    hid that nothing was certified for them (a new user's report)."""
    from router.policy import certified_text, thresholds_text

    g = sv.get("guarantee") or {}
    if sv.get("policy") == "always_top":  # its guarantee block records the test that certified nothing
        g = {**g, "pvalue": None}
    scorer = str(sv.get("scorer") or "router")
    return [f"serves [bold]{sv['policy']}[/bold] at thresholds {thresholds_text(sv['thresholds'])}: "
            f"{certified_text(g, on='cross-fitted questions (every non-held-out one)')}",
            f"not served (the split family, Learn-then-Test on the calibration split; bench traces' rows router and "
            f"router+cascade): {scorer} alone at {thresholds_text(sv['router_thresholds'])}, "
            f"{certified_text(sv.get('router_guarantee'))}; {scorer}+cascade at "
            f"{thresholds_text(sv['cascade_thresholds'])}, {certified_text(sv.get('cascade_guarantee'))}"]


@app.command("calibrate")
def calibrate(
    router_path: Annotated[Path, typer.Argument(help="router file")],
    data: Annotated[list[Path], typer.Argument(help="calibration JSONL file(s)")],
    target_long: Annotated[
        list[str] | None,
        typer.Option(help="fraction of traffic at/above each threshold (one per threshold, decreasing); repeat the "
                          "flag or give them comma-separated: --target-long 0.5,0.2"),
    ] = None,
    max_quality_loss: Annotated[
        float | None, typer.Option(help="max relative quality loss vs always-long (two tiers), e.g. 0.05")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="write here instead of updating ROUTER_PATH")] = None,
) -> None:
    """Choose thresholds RouteLLM-style (score quantile for a target %long, or max quality loss) and save
    them in the router file, under a new version (``<version>+calibrated-<UTC>``: outcomes and promotions tell the
    recalibrated file from the one it came from). A ``metadata.serving`` block gets the new thresholds, and its
    guarantee is dropped: it was certified at the old ones."""
    import datetime as dt

    import numpy as np

    from router.fit.calibrate import fraction_at_or_above, threshold_for_quality_loss, thresholds_for_fractions
    from router.fit.evaluate import outcomes_of
    from router.fit.labels import MIN_LABELLED_ITEMS
    from router.persistence import save_router

    if (target_long is None) == (max_quality_loss is None):
        _fail("give exactly one of --target-long or --max-quality-loss")
    _check_output(out, "--out")
    router = _load(router_path)
    items = _items(data, at_least=MIN_LABELLED_ITEMS)
    scores = router.predict_proba([it.text for it in items])
    if target_long is not None:
        try:
            fractions = [float(x) for v in target_long for x in v.split(",") if x.strip()]
        except ValueError:
            _fail(f"--target-long takes fractions in [0, 1] (e.g. 0.5,0.2), got {target_long}")
        try:
            cuts = thresholds_for_fractions(scores, fractions)
        except ValueError as exc:
            _fail(str(exc))
        how: dict[str, Any] = {"method": "target_long", "target": fractions}
    else:
        qs, ql, _ = outcomes_of(items)
        cuts = [threshold_for_quality_loss(scores, qs, ql, float(max_quality_loss or 0))]
        how = {"method": "max_quality_loss", "target": max_quality_loss}
        quality = float(np.mean(np.where(np.asarray(scores) >= cuts[0], ql, qs)))
        how["quality"], how["always_long_quality"] = round(quality, 4), round(float(ql.mean()), 4)
    achieved = [round(fraction_at_or_above(scores, t), 4) for t in cuts]
    how.update({"achieved_frac_at_or_above": achieved, "n": len(items), "data_files": [str(p) for p in data]})
    was = [round(float(t), 4) for t in router.thresholds]
    router.thresholds = cuts
    meta = router.metadata
    meta["thresholds_calibration"] = how
    before = meta.get("version") or meta.get("created_utc")
    now = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    meta["version"] = f"{str(before or 'router').split('+calibrated-')[0]}+calibrated-{now}"
    meta["calibrated_from"] = before
    if isinstance(meta.get("serving"), dict):
        sv = meta["serving"]
        sv["thresholds"] = [round(float(t), 6) for t in cuts]
        if sv.get("guarantee"):
            sv["guarantee"] = None  # certified at the old thresholds; these carry none
        if sv.get("policy") == "always_top":
            # the file routes at the new thresholds now: "always_top" in router info and /v1/models was false
            # (a new user's file sent 99 of 116 questions cheap under that name)
            cascade = sv.get("cascade") or {}
            suffix = ("+escalation" if "learned" in (cascade.get("escalate_on") or ()) else
                      "+cascade" if cascade else "")
            sv["policy"] = f"{sv.get('scorer') or router.scorer}{suffix}"
    dest = save_router(router, out or router_path)
    shares = ", ".join(f"{a:.1%}" for a in achieved)
    typer.echo(f"thresholds {[round(t, 4) for t in cuts]} (were {was}); share of the {len(items)} calibration "
               f"items at or above each: {shares}")
    typer.echo(f"{len(cuts)} threshold(s): serve with {len(cuts) + 1} routed tiers (routing.routed_tiers; a file with "
               "fewer cuts than a ladder needs serves them at its top boundaries)")
    typer.echo(f"version {meta['version']}; saved {dest}")


@app.command("eval")
def evaluate(
    router_path: Annotated[Path, typer.Argument(help="router file")],
    data: Annotated[list[Path], typer.Argument(help="labelled JSONL file(s); each is reported separately")],
    plot: Annotated[Path | None, typer.Option(help="PNG of the quality-vs-%long curves")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the numbers as JSON")] = None,
    short_cost_ratio: Annotated[float, typer.Option(help="cost(short)/cost(long) per request; 0 = RouteLLM")] = 0.0,
) -> None:
    """AUC, APGR, CPT(50%/80%), cost reduction at 95% of always-long quality vs random; table + PNG."""
    import numpy as np

    from router.fit.evaluate import evaluate_scores, plot_curves, render_table
    from router.fit.labels import MIN_LABELLED_ITEMS

    _check_output(plot, "--plot")
    _check_output(json_out, "--json")
    router = _load(router_path)
    results = []
    for p in data:
        items = _items([p], at_least=MIN_LABELLED_ITEMS)
        scores = np.asarray(router.predict_proba([it.text for it in items]))
        results.append(evaluate_scores(p.name.split(".")[0], items, scores, short_cost_ratio))
    _console().print(render_table(results, title=f"Router {router_path.name}"))
    if plot is not None:
        typer.echo(f"plot: {plot_curves(results, plot)}")
    if json_out is not None:
        json_out.write_text(json.dumps([r.summary() for r in results], indent=2) + "\n")


@app.command("info")
def info(router_path: Annotated[Path, typer.Argument(help="router file")] = _DEFAULT_ROUTER,
         as_json: Annotated[bool, typer.Option("--json", help="print the whole metadata as JSON instead (version, "
                                               "features, label sources, data hash, thresholds, metrics)")] = False,
         ) -> None:
    """Say what a router file serves: version, scorer, thresholds, its promise, policy, cold-start and evaluation
    tables. ``--json``: the file's whole metadata (hundreds of lines on a fitted router) for scripts."""
    r = _load(router_path)
    if as_json:
        typer.echo(json.dumps({**r.metadata, "scorer": r.scorer, "thresholds": r.thresholds,
                               "platt": [r.platt.a, r.platt.b]}, indent=2, sort_keys=True))
        return
    for line in _info_summary(r):
        typer.echo(line)
    typer.echo(f"(the whole metadata: thinkgate router info {router_path} --json)")


def _info_summary(r: Any) -> list[str]:
    """Plain-language lines: what the score is, and per evaluation set how it ranks vs length."""
    from router.policy import guarantee_sentence

    meta = r.metadata
    # first: what the file serves and promises, in one sentence
    lines = [guarantee_sentence(meta) or _no_guarantee_sentence(r, meta)]
    # the one name /v1/models, outcomes and retraining events use (a file may also carry a recipe's router_version)
    lines.append(f"version (as the gateway reports it): {meta.get('version') or meta.get('created_utc')}; scorer "
                 f"{r.scorer}; thresholds {[round(float(t), 6) for t in r.thresholds]}")
    if "policy" in meta:
        # the scorer family the fit chose (what the thresholds cut); what the file serves is the first line
        lines.append(f"scorer chosen at fit: {meta['policy']} — {meta.get('policy_description', '')}")
        lad = meta.get("ladder", {})
        tiers = meta.get("tiers", [])
        cuts = r.thresholds
        lines.append(f"ladder {lad.get('model')}: tiers {tiers} (cheapest first), thresholds {cuts}: score s goes "
                     f"to tiers[#thresholds <= s]; fitted on {meta.get('datasets')}")
        val = meta.get("metrics", {}).get("validation", {})
        if isinstance(val, dict) and val:
            lines.append("validation savings_at_98: " + ", ".join(
                f"{k} {100 * v:.1f}%" for k, v in val.get("savings_at_98", {}).items()))
    lines.extend(_label_validation_lines(meta))
    from router.fit.coldstart import table_lines

    lines.extend(table_lines(meta))
    for row in meta.get("metrics", {}).get("vs_length", []):
        verdict = "no worse than length" if row["ok"] else "WORSE than length"
        lines.append(f"{row.get('kind', 'evaluation set')}: {row['set']}: AUC {row['auc']:.3f} vs length "
                     f"{row['length_auc']:.3f} → {verdict} (n={row['n']})")
    return lines


def _label_validation_lines(meta: dict[str, Any]) -> list[str]:
    """The validation table ``router fit`` on labelled files printed and saved (``metrics.validation``: a list of
    :meth:`router.fit.evaluate.EvalResult.summary` rows, overall then per source), one line per row; [] for other
    files (a trace router's validation is a dict, said above)."""
    m = meta.get("metrics") or {}
    rows = m.get("validation")
    if not isinstance(rows, list) or not rows:
        return []

    def f(v: Any, pct: bool = False) -> str:
        return "—" if not isinstance(v, int | float) else f"{100 * v:.1f}%" if pct else f"{v:.3f}"

    out = [f"validation ({m.get('validation_note') or 'held-out groups'}):"]
    out += [f"  {r.get('name')}: n {r.get('n')}, AUC {f(r.get('auc'))}, APGR {f(r.get('apgr'))}, cost reduction at "
            f"95% of always-long quality {f(r.get('cost_reduction_95'), True)} (random "
            f"{f(r.get('random_cost_reduction_95'), True)})" for r in rows if isinstance(r, dict)]
    return out


def _no_guarantee_sentence(r: Any, meta: dict[str, Any]) -> str:
    """The opening sentence of a file without a Learn-then-Test guarantee: what it serves, and that it promises
    no quality floor."""
    from router.policy import serving

    s = serving(meta) or {}
    policy = s.get("policy") or meta.get("policy") or r.scorer
    what = {"length": "prompt length", "router": "its learned router", "always_top": "always the top tier",
            "pipeline": "its learned text classifier (router fit on labelled files)"}.get(str(policy), str(policy))
    cs = meta.get("cold_start")
    origin = " (the shipped default's cold-start choice, table below)" if isinstance(cs, dict) else ""
    # a file fitted from labels has no thresholds until `router calibrate`: a gateway refuses it without
    # routing.thresholds, so "serves … at the thresholds below" would be false
    where = ("at the thresholds below" if r.thresholds else
             "once it has thresholds — it has none yet: run thinkgate router calibrate FILE DATA, or set "
             "routing.thresholds")
    return (f"Serves {what}{origin} {where}; it states no quality guarantee (no Learn-then-Test "
            "calibration on outcomes of your models) — fit a router on your traffic for one (docs/router.md).")


@app.command("score")
def score(
    text: Annotated[str, typer.Argument(help="routing window text")],
    router_path: Annotated[Path, typer.Option("--router")] = _DEFAULT_ROUTER,
) -> None:
    """Score one text: P(needs long) and the tier its thresholds pick for tiers short/long."""
    r = _load(router_path)
    s = r.score(text)
    tiers = r.metadata.get("tiers")  # a trace router's ladder settings; else the gateway's default tier names
    names = [str(t) for t in tiers] if isinstance(tiers, list) and len(tiers) == len(r.thresholds) + 1 else \
        ["short", "long"] if len(r.thresholds) == 1 else None
    tier = r.route(s, names) if names else "?"
    typer.echo(json.dumps({"difficulty": round(s, 4), "thresholds": r.thresholds, "tier": tier}))


@app.command("build-default")
def build_default(
    out: Annotated[Path, typer.Option(help="the learned candidate to write (then `router cold-start` decides "
                                           "what the shipped default serves)")] = _LEARNED_ROUTER,
    plot: Annotated[Path | None, typer.Option(help="PNG of the held-out curves")] = Path(
        "bench/results/router_default.png"),
    seed: int = 0,
    transfer: Annotated[bool, typer.Option(help="also refit without each source (held-out data set rows)")] = False,
) -> None:
    """Rebuild the learned default candidate from the data in data/ (see docs/router.md "The shipped router");
    then run `thinkgate router cold-start` to decide and write the shipped default."""
    from router.fit.default import build_default_router

    build_default_router(out, plot=plot, seed=seed, console=_console(), transfer=transfer)


@app.command("cold-start")
def cold_start(
    learned: Annotated[Path, typer.Option(help="the learned candidate (build-default's output)")] = _LEARNED_ROUTER,
    out: Annotated[Path, typer.Option(help="the shipped default to write")] = _DEFAULT_ROUTER,
    transfer: Annotated[Path | None, typer.Option(help="the recipe fitted without trace rows (scores the trace "
                                                         "sets; default: fitted now, a few minutes)")] = None,
    refit: Annotated[bool, typer.Option(help="fit the no-traces recipe when --transfer is not given (else the "
                                             "candidate scores the trace sets, questions held out only)")] = True,
) -> None:
    """Measure the learned candidate vs prompt length vs random on the real outcome sets it was not fitted on and
    ship the learned router only where it is no worse than length everywhere, else length (router/fit/coldstart.py)."""
    from router.fit.coldstart import build_cold_start_default, table_lines
    from router.persistence import load_router

    build_cold_start_default(learned, out, transfer, say=typer.echo, refit=refit)
    for line in table_lines(load_router(out, pipeline=False).metadata):
        typer.echo(line)
