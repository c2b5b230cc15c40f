"""The GRPO output model directory is servable: a short run on the shipped model, then the real vLLM server
(``gateway.engine.vllm.LocalEngine``) loads ``<run>/model`` and answers a chat request with a reasoning part."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import DEFAULT_MODEL_DIR, EngineConfig
from gateway.engine.vllm import LocalEngine
from tests.fixtures.engine import STARTUP_TIMEOUT_S, start_outside_test_timeout
from training.grpo.config import RunConfig, from_dict

# a 2-step GRPO run and its eval on a shared CPU: over 300 s on a loaded box (the engine's start is not counted)
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]


def test_grpo_output_serves_in_vllm(tmp_path: Path, port_lease: Callable[[], int]) -> None:
    from training.grpo.run import run_grpo

    cfg = from_dict(
        RunConfig,
        {
            "model": {"path": str(DEFAULT_MODEL_DIR)},
            "task": {"name": "arith", "n_train": 8, "n_eval": 4, "difficulties": [1]},
            "eval": {"before": False, "after": True, "max_new_tokens": 48},
            "trl": {"num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 48,
                    "max_steps": 2, "save_steps": 100},
        },
    )
    run_dir = tmp_path / "run"
    summary = run_grpo(cfg, output_dir=run_dir, progress=False)
    assert summary["global_step"] == 2
    tier = yaml.safe_load((run_dir / "tier.yaml").read_text())["tiers"][0]

    # bounded as the session's engine is (up to ~4 min measured on a loaded box; 240 s timed out there, and the
    # start was charged to this test's timeout after the GRPO run)
    ecfg = EngineConfig(model_path=run_dir / "model", served_model_name=tier["model"], port=port_lease(),
                        startup_timeout_s=STARTUP_TIMEOUT_S)
    eng = LocalEngine(ecfg, state_dir=tmp_path / "engine-state")
    start_outside_test_timeout(eng)
    with eng:
        r = httpx.post(
            f"{eng.base_url}/chat/completions",
            json={"model": tier["model"], "max_tokens": 48,
                  "messages": [{"role": "user", "content": "Start with 3. Add 4. What is the result?"}]},
            timeout=60,
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == tier["model"]
    assert body["usage"]["completion_tokens"] > 0
    assert body["choices"][0]["message"].get("reasoning") is not None
