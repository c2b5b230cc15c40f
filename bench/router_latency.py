"""Router prediction latency per request (one request at a time, not batched).

For prompts of 100, 2,000 and 20,000 characters (cut from real MATH-500 problems joined together), times
``TrainedRouter.score(text)`` — the request path's fast scorer — and, for reference, the sklearn Pipeline on a
one-element batch. Prints p50/p99 (and min) in milliseconds, the host load average (this machine is shared:
the minimum is the best estimate of the uncontended cost), and checks both paths agree.

    python -m bench.router_latency [--router router/assets/default-learned.skops] [--corpus Q.jsonl.gz]
                                   [--n 2000] [--json out] [--escalation]

``--escalation`` also times answer-aware escalation scoring (``router.escalation``: the features of one
finished answer + the stored logistic model, what ``escalate_on: [learned]`` runs per cheap answer) on
answers of 100, 2,000 and 20,000 characters cut from the shipped traces' recorded cheap answers, with a
thought of 1,800 characters and a 2,000-character question (MATH-500) beside it; the model's cost does not
depend on its coefficients.

Targets: p50 ≤ 0.3 ms at 2,000 characters (router score; escalation scoring).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from router.escalation import FEATURES, answer_features, model_probability
from router.fit.jsonl import read_jsonl
from router.persistence import load_router
from router.tasks.datasets import data_file

REPO = Path(__file__).resolve().parent.parent

SIZES = (100, 2000, 20000)
ANSWERS = REPO / "data" / "traces" / "frames" / "Qwen3-14B__no_think.jsonl.gz"


def corpus_text(chars: int, corpus: Path | None = None, field: str | None = None) -> str:
    """``chars`` characters of real prompts joined (repeated if needed): MATH-500 problems by default, or the
    ``problem``/``question`` field (``field`` when given, e.g. a traces ladder file's ``response``) of each row of
    ``corpus`` (e.g. a traces folder's questions.jsonl.gz)."""
    path = corpus or data_file("math", "test")
    rows = read_jsonl(path)
    if field is not None:
        text = "\n\n".join(str(row.get(field) or "") for row in rows)
    else:
        text = "\n\n".join(str(row.get("problem", row.get("question", ""))) for row in rows)
    while len(text) < chars:
        text += "\n\n" + text
    return text[:chars]


def timings_ms(fn, arg: str, n: int, warmup: int = 50) -> np.ndarray:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn(arg)
    out = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        fn(arg)
        out[i] = time.perf_counter() - t0
    return out * 1000.0


def escalation_rows(n: int) -> list[dict[str, float]]:
    """``[{"chars", "p50_ms", "p99_ms", "min_ms"}]`` per answer size in :data:`SIZES`: one escalation scoring
    (answer features + model), ``n`` timed calls each after a warm-up."""
    d = len(FEATURES)
    model = {"features": list(FEATURES), "mean": [0.0] * d, "scale": [1.0] * d, "coef": [0.1] * d,
             "intercept": -1.0}
    thought = corpus_text(1800, ANSWERS, "response")
    question = corpus_text(2000)
    rows = []
    for size in SIZES:
        answer = corpus_text(size, ANSWERS, "response")

        def score(a: str) -> float:
            return model_probability(model, answer_features(a, thought, completion_tokens=900.0,
                                                            reasoning_tokens=700.0, finish_reason="stop",
                                                            question=question, score=0.4))
        t = timings_ms(score, answer, n)
        rows.append({"chars": size, "p50_ms": float(np.percentile(t, 50)), "p99_ms": float(np.percentile(t, 99)),
                     "min_ms": float(t.min())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", type=Path, default=REPO / "router" / "assets" / "default-learned.skops")
    ap.add_argument("--n", type=int, default=2000, help="timed requests per size (fast path)")
    ap.add_argument("--n-sklearn", type=int, default=100, help="timed requests per size (sklearn Pipeline)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--corpus", type=Path, default=None,
                    help="JSONL(.gz) of prompts (problem/question field) to cut from; default MATH-500")
    ap.add_argument("--escalation", action="store_true",
                    help="also time answer-aware escalation scoring (router.escalation) per answer size")
    args = ap.parse_args()

    router = load_router(args.router)
    rows = []
    load = os.getloadavg()
    for size in SIZES:
        text = corpus_text(size, args.corpus)
        fast = timings_ms(router.score, text, args.n)
        skl = timings_ms(lambda t: router.predict_proba([t])[0], text, args.n_sklearn, warmup=5)
        diff = abs(router.score(text) - float(router.predict_proba([text])[0]))
        rows.append({
            "chars": size,
            "fast_p50_ms": float(np.percentile(fast, 50)),
            "fast_p99_ms": float(np.percentile(fast, 99)),
            "fast_min_ms": float(fast.min()),
            "sklearn_p50_ms": float(np.percentile(skl, 50)),
            "sklearn_p99_ms": float(np.percentile(skl, 99)),
            "abs_diff": diff,
        })
    print(f"router {args.router.name} ({router.scorer}); prompts from {(args.corpus or 'MATH-500')}; "
          f"{os.cpu_count()} CPUs; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    head = ("chars", "p50 ms", "p99 ms", "min ms", "sklearn p50", "sklearn p99", "|diff|")
    print(f"{head[0]:>7} {head[1]:>8} {head[2]:>8} {head[3]:>8} {head[4]:>12} {head[5]:>12} {head[6]:>9}")
    for r in rows:
        print(f"{r['chars']:>7} {r['fast_p50_ms']:>8.3f} {r['fast_p99_ms']:>8.3f} {r['fast_min_ms']:>8.3f} "
              f"{r['sklearn_p50_ms']:>12.3f} {r['sklearn_p99_ms']:>12.3f} {r['abs_diff']:>9.1e}")
    target = next(r for r in rows if r["chars"] == 2000)["fast_p50_ms"]
    print(f"p50 at 2,000 chars: {target:.3f} ms (target ≤ 0.3 ms: {'met' if target <= 0.3 else 'NOT met'})")
    out: dict[str, object] = {"load_average": load, "rows": rows}
    if args.escalation:
        esc = escalation_rows(args.n)
        print(f"escalation scoring (answer features + model; answers from {ANSWERS.name}):")
        print(f"{'chars':>7} {'p50 ms':>8} {'p99 ms':>8} {'min ms':>8}")
        for r in esc:
            print(f"{r['chars']:>7} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['min_ms']:>8.3f}")
        at = next(r for r in esc if r["chars"] == 2000)["p50_ms"]
        print(f"escalation p50 at 2,000 chars: {at:.3f} ms (target ≤ 0.3 ms: {'met' if at <= 0.3 else 'NOT met'})")
        out["escalation"] = esc
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
