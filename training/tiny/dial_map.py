"""``thinkgate train dial-router``: a router file that routes ``model: auto`` to a thinking budget on a dial model.

Steps (offline, CPU):

1. ``n`` problems of the ``arith`` **train** split (``load_task('arith', 'train', n, seed)``: never the held-out
   split that ``thinkgate eval dial`` and ``thinkgate bench savings`` measure on), difficulties cycling 1–6 as the
   bench's workload does;
2. the dial model answers each at every candidate budget (:func:`training.tiny.dial_eval.answer_with_budget`:
   the dial prompt, greedy, the gateway's hard stop), giving correctness and thinking tokens per (budget, problem);
3. the router (``--router``, default the shipped default) scores each question's routing window as the gateway
   would (:func:`router.window.routing_window`);
4. :func:`router.fit.budget_map.fit_budget_map` certifies the cheapest monotone score → budget map that keeps
   ``floor`` × the tier's own (last candidate's) accuracy with confidence 1 − δ (Learn-then-Test);
5. the output file is the router with every routed request sent to ``tier`` (thresholds 0) and the map in
   ``metadata.serving.budgets``; a JSON report beside it when asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def parse_budgets(text: str) -> list[int | None]:
    """``"16,32,64,unlimited"`` → ``[16, 32, 64, None]``. Raises ValueError unless ascending positive integers
    with at most one ``unlimited`` at the end."""
    out: list[int | None] = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        out.append(None if part in ("unlimited", "none", "null") else int(part))
    finite = [b for b in out if b is not None]
    if not out or finite != sorted(set(finite)) or any(b < 1 for b in finite) or None in out[: len(finite)]:
        raise ValueError(f"budgets must be ascending positive integers, 'unlimited' only last: {text!r}")
    return out


def outcomes(model_dir: str, budgets: Sequence[int | None], n: int, seed: int, threads: int,
             log: Callable[[str], Any] = print) -> tuple[list[Any], np.ndarray, np.ndarray]:
    """(problems, correct (m, n) bool, thinking tokens (m, n)) of the dial model at each budget."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from router.tasks import load_task
    from training.tiny.dial_eval import answer_with_budget

    torch.set_num_threads(threads)
    problems = load_task("arith", "train", n, seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    correct = np.zeros((len(budgets), len(problems)), dtype=bool)
    tokens = np.zeros((len(budgets), len(problems)), dtype=np.float64)
    for j, b in enumerate(budgets):
        outs = answer_with_budget(model, tok, problems, b)
        correct[j] = [o.correct for o in outs]
        tokens[j] = [o.thinking_tokens for o in outs]
        log(f"budget {'unlimited' if b is None else b}: accuracy {correct[j].mean():.1%}, "
            f"mean thinking tokens {tokens[j].mean():.1f}")
    return problems, correct, tokens


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when under it (a report holds no build machine's paths)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name if path.is_absolute() else str(path)


def dial_version(base: object, model_name: str) -> str:
    """The dial router's version: the version of the router it was built from (the shipped default's), ``+dial-``
    and the dial model directory's name — deterministic, so a rebuild from the same inputs names the same policy."""
    return f"{str(base or 'router').split('+dial-')[0]}+dial-{model_name}"


def build(model_dir: str, router_path: Path, out: Path, *, tier: str = "long",
          budgets: Sequence[int | None] = (16, 32, 48, 64, 96, 128, None), n: int = 400, seed: int = 0,
          n_bins: int = 4, floor: float = 0.98, delta: float = 0.1, threads: int = 2,
          log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Steps 1–5 of the module doc; returns the report (also what ``--json`` writes)."""
    from router.fit.budget_map import fit_budget_map
    from router.persistence import load_router, save_router
    from router.window import routing_window

    router = load_router(router_path)
    problems, correct, tokens = outcomes(model_dir, budgets, n, seed, threads, log)
    scores = np.array([router.score(routing_window([{"role": "user", "content": p.question}]))
                       for p in problems])
    fit = fit_budget_map(tier, [p.id for p in problems], scores, budgets, correct, tokens, n_bins=n_bins,
                         floor=floor, delta=delta)
    meta = dict(router.metadata)
    serving = dict(meta.get("serving") or {})
    n_cuts = max(1, len(router.thresholds))
    serving.update({"policy": f"{serving.get('policy') or router.scorer}+budgets", "scorer": router.scorer,
                    "thresholds": [0.0] * n_cuts, "budgets": fit.to_serving()})
    # a version of its own: the gateway, `router info`/`history` and a rollback's router:bad name a file by it, and a
    # copy of the default's made two different files answer to one name
    meta["version"] = dial_version(meta.get("version") or meta.get("created_utc"), Path(model_dir).name)
    meta.update({"serving": serving, "dial_model": Path(model_dir).name,
                 "policy_description": "every routed request goes to the dial tier "
                                       f"{tier!r} with a thinking budget picked from the router score"})
    meta.pop("cold_start", None)  # this file is not the shipped default's cold start
    meta.pop("thresholds_calibration", None)  # nor are its thresholds the default's: every routed request -> tier
    router.thresholds = [0.0] * n_cuts
    router.metadata = meta
    save_router(router, out)
    report = {"model": _shown(Path(model_dir)), "router": _shown(router_path), "out": _shown(out),
              "n_problems": len(problems),
              "seed": seed, "budgets": [None if b is None else int(b) for b in budgets],
              "per_budget": [{"budget": b, "accuracy": round(float(correct[j].mean()), 4),
                              "mean_thinking_tokens": round(float(tokens[j].mean()), 2)}
                             for j, b in enumerate(budgets)],
              "served": fit.to_serving()}
    g = report["served"]["guarantee"]
    log(f"map: cuts {list(fit.map.cuts)} -> budgets {list(fit.map.budgets)} (certified {fit.certified}; "
        f"calibration accuracy ratio {g['calibration_accuracy_ratio']}, token share {g['calibration_token_share']} "
        f"of the tier's own setting, on {fit.n_calibration} questions)")
    return report
