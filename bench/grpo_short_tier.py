"""The length-penalised GRPO model served as the gateway's ``short`` tier vs the SFT model as ``long``:
accuracy and reasoning tokens per difficulty, measured through the real gateway with ``thinkgate eval tiers``.

Starts two vLLM servers (``gateway.engine.LocalEngine``: the SFT model and ``--model-dir``), a gateway
(``thinkgate serve``, engine off) whose tiers are ``long`` = SFT model, ``short`` = GRPO model (no thinking
budget on either, so the difference is the model's own length), and ``none`` = SFT with thinking off; then runs
``thinkgate eval tiers --tiers long,short`` and writes the table.

    .venv/bin/python bench/grpo_short_tier.py --model-dir runs/bench/length/alp_length/model [--n-per-level 20]
        [--levels 1,2,3,4] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpo_common as gc

from gateway.config import DEFAULT_MODEL_DIR, EngineConfig
from gateway.engine import LocalEngine
from gateway.redis_server import free_port

SECRET = "tg-bench-grpo-short-0000000000"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True, help="GRPO output model directory (…/model)")
    ap.add_argument("--sft-dir", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--n-per-level", type=int, default=20)
    ap.add_argument("--levels", default="1,2,3,4")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--write-results", action="store_true")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="grpo-short-"))
    engines = {
        "long": LocalEngine(
            EngineConfig(
                model_path=Path(a.sft_dir), served_model_name="thinkgate-tiny", port=free_port(), startup_timeout_s=300
            ),
            state_dir=tmp / "e1",
        ),
        "short": LocalEngine(
            EngineConfig(
                model_path=Path(a.model_dir),
                served_model_name="thinkgate-tiny-short",
                port=free_port(),
                startup_timeout_s=300,
            ),
            state_dir=tmp / "e2",
        ),
    }
    gw = None
    try:
        for e in engines.values():
            e.start()
        port = free_port()
        tiers = [
            {
                "name": "none",
                "base_url": engines["long"].base_url,
                "model": "thinkgate-tiny",
                "enable_thinking": False,
                "max_tokens": a.max_tokens,
                "budget_mode": "off",
            },
            {
                "name": "short",
                "base_url": engines["short"].base_url,
                "model": "thinkgate-tiny-short",
                "max_tokens": a.max_tokens,
                "budget_mode": "off",
            },
            {
                "name": "long",
                "base_url": engines["long"].base_url,
                "model": "thinkgate-tiny",
                "max_tokens": a.max_tokens,
                "budget_mode": "off",
            },
        ]
        cfg = {
            "engine": {"enabled": False},
            "server": {"port": port},
            "tiers": tiers,
            "auth": {"keys": [{"id": "bench", "secret": SECRET}]},
            "redis": {"key_prefix": f"tgbench:{os.getpid()}:"},
            "metering": {"spool_path": str(tmp / "spool.jsonl")},
            "routing": {"router_path": None, "on_router_error": "default_tier"},
        }
        cfg_path = tmp / "gateway.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        log = (tmp / "gateway.log").open("w")
        gw = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=gc.ROOT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"gateway did not start; see {tmp / 'gateway.log'}")
        out = tmp / "eval.json"
        env = {**os.environ, "THINKGATE_URL": f"http://127.0.0.1:{port}", "THINKGATE_API_KEY": SECRET}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "eval",
                "tiers",
                "--tiers",
                "long,short,none",
                "--n-per-level",
                str(a.n_per_level),
                "--levels",
                a.levels,
                "--json",
                str(out),
            ],
            env=env,
            check=True,
            cwd=gc.ROOT,
        )
        result = json.loads(out.read_text())
    finally:
        if gw is not None:
            gw.terminate()
            gw.wait(timeout=30)
        for e in engines.values():
            e.stop()

    rows = []
    for tier in ("long", "short", "none"):
        t = result["tiers"][tier]
        for d, s in [*t["by_difficulty"].items(), ("all", t)]:
            rows.append([tier, d, s["accuracy"], s["mean_reasoning_tokens"], s["max_reasoning_tokens"], s["requests"]])
    table = gc.md_table(
        ["tier", "difficulty", "accuracy", "mean reasoning tokens", "max reasoning tokens", "requests"], rows
    )
    long_all, short_all = result["tiers"]["long"], result["tiers"]["short"]
    body = (
        f"`bench/grpo_short_tier.py` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: through the gateway "
        f"(`thinkgate eval tiers`, greedy, no thinking budget on either tier): `long` = the SFT model "
        f"(`{Path(a.sft_dir).name}`), `short` = the GRPO model `{a.model_dir}`, `none` = SFT with thinking off; "
        f"{a.n_per_level} held-out arith problems per level {a.levels}, each served by vLLM (CPU build).\n\n"
        f"{table}\n\nShort vs long overall: accuracy {short_all['accuracy']:.3f} vs {long_all['accuracy']:.3f}, "
        f"mean reasoning tokens {short_all['mean_reasoning_tokens']:.1f} vs {long_all['mean_reasoning_tokens']:.1f}."
    )
    print(body)
    if a.write_results:
        gc.write_subsection("Short tier through the gateway", body)


if __name__ == "__main__":
    main()
