"""Where the embedded engine's model comes from: the source checkout's ``models/`` (the product wheel ships no
model), and ``thinkgate serve`` on the engine with no model there ends at once with one line naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gateway.config import DEFAULT_MODEL_DIR, MODELS_DIR, Settings, missing_model

REPO = Path(__file__).resolve().parents[2]


def test_the_default_model_is_the_checkouts_models_folder() -> None:
    assert MODELS_DIR == REPO / "models"
    assert Settings.load(None).engine.model_path == DEFAULT_MODEL_DIR == REPO / "models" / "thinkgate-tiny"
    assert missing_model(DEFAULT_MODEL_DIR) is None  # config.json is there in a checkout
    assert not (REPO / "training" / "assets").exists()  # the models left the training package


def test_serve_without_a_model_says_how_to_fix_it_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("THINKGATE_")}
    env.update(PYTHONPATH=str(REPO), THINKGATE_STATE_DIR=str(tmp_path / "state"),
               THINKGATE_ENGINE__MODEL_PATH=str(tmp_path / "no-model"), THINKGATE_REDIS__START_IF_MISSING="false")
    r = subprocess.run([sys.executable, "-m", "gateway", "serve"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    line = r.stderr.strip()
    assert line.startswith(f"thinkgate: no model for the embedded engine at {tmp_path / 'no-model'}"), line
    for fix in ("THINKGATE_ENGINE__MODEL_PATH", "source checkout", "THINKGATE_ENGINE__ENABLED=false"):
        assert fix in line, line
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())  # nothing started
