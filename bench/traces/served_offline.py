"""What a trace router file serves on the held-out questions, offline, for several confidence levels δ (the
guarantee's trade-off): fit per ladder (``router.fit.ladder_fit.fit_ladder_router``, held-out excluded), then serve
``metadata.serving`` exactly as the gateway would — its scorer and thresholds, the cascade with its phrases or not —
on the held-out questions' recorded outcomes.

    python -m bench.traces.served_offline --traces ../shared/data/traces [--delta 0.1 --delta 0.3] [--json OUT]

Reporting only: δ is a promise the operator picks (the shipped default 0.1 was fixed before any held-out number
was seen); nothing here feeds back into a fit. Pure offline (recorded outcomes), ~15 s per δ on 2 cores.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.router_traces import DEFAULT_TRACES, LADDERS, check_traces_folder, fail
from router.abstention import abstains
from router.escalation import answer_features, should_escalate
from router.fit.ladder_eval import abstain_matrix, cascade_outcome, route
from router.fit.ladder_fit import fit_ladder_router
from router.fit.traces import LadderData, heldout_mask, load_ladder
from router.policy import cascade_of


def learned_cascade(test: LadderData, scores: np.ndarray, choice: np.ndarray, models: dict[str, dict[str, Any]],
                    phrases: Sequence[str] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The file's answer-aware cascade on recorded answers, as the gateway serves it: from the routed tier,
    escalate while the tier has a model and its answer abstains or ``should_escalate`` (features of what the
    gateway sees: answer, thought, usage, question, router score). (final tier, correct, tokens paid) per row."""
    k = test.correct.shape[1]
    final = np.asarray(choice, dtype=np.int64).copy()
    correct = np.zeros(test.n, dtype=bool)
    tokens = np.zeros(test.n)
    for i in range(test.n):
        cur = int(final[i])
        spent = float(test.tokens[i, cur])
        while cur < k - 1 and (m := models.get(test.ladder.settings[cur])) is not None:
            rt = float(test.reasoning_tokens[i, cur])
            x = answer_features(test.responses[i][cur], test.thoughts[i][cur] if test.thoughts else "",
                                completion_tokens=float(test.tokens[i, cur]),
                                reasoning_tokens=None if np.isnan(rt) else rt, finish_reason="stop",
                                question=test.questions[i], score=float(scores[i]), phrases=phrases)
            if not (abstains(test.responses[i][cur], phrases) or should_escalate(m, x)):
                break
            cur += 1
            spent += float(test.tokens[i, cur])
        final[i], correct[i], tokens[i] = cur, bool(test.correct[i, cur]), spent
    return final, correct, tokens


def served_on_heldout(traces: Path, dataset: str, ladder: str, delta: float, floor: float = 0.98
                      ) -> dict[str, Any]:
    """Accuracy ratio, savings and correct counts of the file's served policy on the held-out questions."""
    fit = fit_ladder_router(traces, [dataset], ladder, delta=delta, quality_target=floor)
    data = load_ladder(traces, dataset, ladder)
    test = data.subset(np.flatnonzero(heldout_mask(data)))
    r = fit.router
    scores = np.array([r.score(q) for q in test.questions])
    choice = route(scores, r.thresholds)
    rows = np.arange(test.n)
    cascade = cascade_of(r.metadata)
    if cascade is None:
        correct, tokens = test.correct[rows, choice], test.tokens[rows, choice]
    elif cascade.models:
        _, correct, tokens = learned_cascade(test, scores, choice, cascade.models, cascade.phrases)
    else:
        ab = abstain_matrix(test.responses, cascade.phrases)
        _, correct, tokens = cascade_outcome(choice, test.correct, test.tokens, ab)
    top_c, top_t = float(test.correct[:, -1].sum()), float(test.tokens[:, -1].sum())
    return {"dataset": dataset, "ladder": ladder, "delta": delta, "n": test.n,
            "policy": r.metadata["serving"]["policy"], "guarantee": r.metadata["serving"]["guarantee"],
            "correct": float(np.sum(correct)), "top_correct": top_c,
            "accuracy_ratio": round(float(np.sum(correct)) / top_c, 4) if top_c else 1.0,
            "savings": round(1 - float(np.sum(tokens)) / top_t, 4)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--delta", type=float, action="append")
    ap.add_argument("--floor", type=float, action="append", help="the promised floor (default 0.98; repeatable)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    check_traces_folder(args.traces)
    out = []
    for floor, delta in [(f, d) for f in args.floor or [0.98] for d in args.delta or [0.1]]:
        try:
            rows = [served_on_heldout(args.traces, ds, lad, delta, floor) for ds, lad in LADDERS]
        except (FileNotFoundError, ValueError) as exc:  # a data set, model or setting the folder lacks
            fail(str(exc))
        two = [x for x in rows if len(x["ladder"].split(",")) == 2]
        pooled = sum(x["correct"] for x in two) / sum(x["top_correct"] for x in two)
        print(f"floor {floor}, delta {delta}: pooled accuracy ratio {pooled:.3f}, "
              f"worst {min(x['accuracy_ratio'] for x in two):.3f}, "
              f"mean savings {np.mean([x['savings'] for x in two]):.1%} (two-tier ladders)")
        for x in rows:
            print(f"  {x['dataset']:8} {x['ladder']:48} {x['policy']:16} ratio {x['accuracy_ratio']:.3f} "
                  f"savings {x['savings']:.1%}")
        out.append({"delta": delta, "floor": floor, "pooled_accuracy_ratio": round(pooled, 4), "ladders": rows})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
