"""One abstention rule: the function the trace router is calibrated with (router.fit.ladder_eval) is the one the
gateway's cascade serves (gateway.pipeline.abstention), on every recorded cheap answer of the traces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from gateway.pipeline import abstention as serving
from router import abstention
from router.fit import ladder_eval

# the traces the repository ships (data/traces: every answer of the shared set, without its grading), so a clean
# clone runs this check too; the shared folder beside the checkout only where the repository's copy is missing
TRACES = next((p for p in (Path(__file__).resolve().parents[2] / "data" / "traces",
                           Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces") if p.is_dir()),
              None)
TOP = ("exd0", "budget1024", "high_effort")  # each model's most expensive setting: never a cascade's first answer


def test_fit_and_serving_use_the_same_function() -> None:
    assert ladder_eval.abstains is abstention.abstains
    assert serving.abstains is abstention.abstains and serving.DEFAULT_PHRASES is abstention.DEFAULT_PHRASES


@pytest.mark.skipif(TRACES is None, reason="no data/traces in the checkout (nor ../shared/data/traces beside it)")
def test_fit_and_serving_agree_on_every_recorded_cheap_answer() -> None:
    assert TRACES is not None
    n = flagged = 0
    disagree = []
    for f in sorted(TRACES.glob("*/*__*.jsonl.gz")):
        if f.name[: -len(".jsonl.gz")].partition("__")[2] in TOP:
            continue
        with gzip.open(f, "rt") as fh:
            for line in fh:
                text = json.loads(line).get("response")
                fit = ladder_eval.abstain_matrix([[text]])[0, 0]
                if fit != serving.abstains(text):
                    disagree.append((f.name, str(text)[-80:]))
                n += 1
                flagged += bool(fit)
    assert n > 7_500 and 0 < flagged < n  # 7,855 cheap answers in data/traces (9,819 with the medium settings)
    assert not disagree, f"{len(disagree)} of {n} cheap answers differ, e.g. {disagree[:3]}"
