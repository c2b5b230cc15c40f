"""The serving process stays lean: building the gateway with the shipped router and scoring a prompt imports
neither scikit-learn nor SciPy nor skops (the router file carries its fast-path arrays; router/persistence.py).
Checked in a fresh interpreter, since this test process has imported them already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the learned default candidate (the shipped default serves prompt length: router/fit/coldstart.py)
SHIPPED = REPO / "router" / "assets" / "default-learned.skops"
HEAVY = ("sklearn", "scipy", "skops", "pandas", "pyarrow", "torch")

SCRIPT = """
import json, sys
import uvicorn  # the serve command's server
import gateway.cli.serve
from gateway.app import create_app
from gateway.config import Settings

settings = Settings.load(None, engine={"enabled": False},
                         redis={"url": "redis://127.0.0.1:1/0", "start_if_missing": False},
                         tiers=[{"name": "short", "base_url": "http://127.0.0.1:1/v1", "model": "m"},
                                {"name": "long", "base_url": "http://127.0.0.1:1/v1", "model": "m"}],
                         routing={"router_path": sys.argv[1], "routed_tiers": ["short", "long"],
                                  "on_router_error": "refuse_start",
                                  "effort_tiers": {"low": "short", "high": "long"}})
app = create_app(settings)
svc = app.state.routing.service
score = svc.score("Prove that there are infinitely many primes.")
print(json.dumps({"mode": svc.mode, "score": score, "pipeline": svc.router.pipeline is not None,
                  "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def serve_modules(router_path: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(router_path)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_serving_the_shipped_router_imports_no_sklearn_scipy_or_skops() -> None:
    info = serve_modules(SHIPPED)
    assert info["mode"] == "router" and info["pipeline"] is False
    assert 0.0 <= float(info["score"]) <= 1.0  # type: ignore[arg-type]
    assert "numpy" in info["modules"]  # the fast path ran
    assert not set(HEAVY) & set(info["modules"])  # type: ignore[arg-type]


def test_a_file_without_fast_arrays_still_serves_through_sklearn(tmp_path: Path) -> None:
    # Written before the "fast" block existed: loaded in full (skops + sklearn), scored the same.
    import skops.io as sio

    from router.persistence import load_router

    old = tmp_path / "v1-no-fast.skops"
    obj = sio.load(SHIPPED, trusted=sio.get_untrusted_types(file=SHIPPED))
    del obj["fast"]
    sio.dump(obj, old)
    info = serve_modules(old)
    assert info["mode"] == "router" and info["pipeline"] is True and "sklearn" in info["modules"]  # type: ignore[operator]
    assert info["score"] == load_router(SHIPPED).score("Prove that there are infinitely many primes.")


def test_a_model_free_baseline_file_serves_without_sklearn_too(tmp_path: Path) -> None:
    from router.model import TrainedRouter, length_prior
    from router.persistence import save_router

    p = save_router(TrainedRouter(pipeline=None, scorer="length", thresholds=[0.4], metadata={"policy": "length"}),
                    tmp_path / "length.skops")
    info = serve_modules(p)
    assert info["mode"] == "router" and info["pipeline"] is False
    assert info["score"] == length_prior("Prove that there are infinitely many primes.")
    assert not set(HEAVY) & set(info["modules"])  # type: ignore[arg-type]
