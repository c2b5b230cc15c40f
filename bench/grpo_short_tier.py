"""The length-penalised GRPO model served as the gateway's ``short`` tier vs the SFT model in the same tier:
accuracy and reasoning tokens per difficulty, measured through the real gateway with ``thinkgate eval tiers``.

Starts two vLLM servers (``gateway.engine.vllm.LocalEngine``: the SFT model and ``--model-dir``) and a gateway
(``thinkgate serve``, engine off) with the default tiers' settings (budgets, max_tokens, budget mode, prices)
and the model swapped: ``short`` = GRPO model, ``short_sft`` = SFT model (both the default short budget),
``long`` = SFT model, ``long_grpo`` = GRPO model (both the default long budget); then runs
``thinkgate eval tiers`` on them and writes the table (and ``bench/results/grpo_short_tier.json``).

    .venv/bin/python bench/grpo_short_tier.py --model-dir models/thinkgate-tiny-short [--n-per-level 20]
        [--levels 1,2,3,4,5,6] [--write-results]
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

import bench.grpo_common as gc
from gateway.config import DEFAULT_MODEL_DIR, EngineConfig
from gateway.engine.redis_server import free_port
from gateway.engine.vllm import LocalEngine

SECRET = "tg-bench-grpo-short-0000000000"
TIERS = ("short", "short_sft", "long", "long_grpo")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True, help="GRPO output model directory (…/model)")
    ap.add_argument("--sft-dir", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--n-per-level", type=int, default=20)
    ap.add_argument("--levels", default="1,2,3,4,5,6")
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
        # The default tiers' settings (budgets, max_tokens, budget mode, prices) with the model swapped: the
        # length-penalised model served as `short` against the SFT model in the same tier (`short_sft`), and
        # both under the long tier's settings (`long` = SFT, as shipped; `long_grpo`).
        from gateway.config import _default_tiers

        defaults = {t.name: t.model_dump(mode="json") for t in _default_tiers()}
        sft = (engines["long"].base_url, "thinkgate-tiny")
        grpo = (engines["short"].base_url, "thinkgate-tiny-short")
        tiers = [
            {**defaults[base], "name": name, "base_url": url, "model": model, "escalate_on": []}
            for name, base, (url, model) in (
                ("short", "short", grpo),
                ("short_sft", "short", sft),
                ("long", "long", sft),
                ("long_grpo", "long", grpo),
            )
        ]
        cfg = {
            "engine": {"enabled": False},
            "server": {"port": port},
            "tiers": tiers,
            "auth": {"keys": [{"id": "bench", "secret": SECRET}]},
            "redis": {"key_prefix": f"tgbench:{os.getpid()}:"},
            "metering": {"spool_path": str(tmp / "spool.jsonl")},
            "routing": {
                "router_path": None,
                "on_router_error": "default_tier",
                "routed_tiers": ["short", "long"],
                "default_tier": "long",
                "effort_tiers": {},
            },
        }
        cfg_path = tmp / "gateway.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        log = (tmp / "gateway.log").open("w")
        gw = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--config", str(cfg_path)],
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
                "gateway",
                "eval",
                "tiers",
                "--tiers",
                ",".join(TIERS),
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
    for tier in TIERS:
        t = result["tiers"][tier]
        for d, s in [*t["by_difficulty"].items(), ("all", t)]:
            rows.append([tier, d, s["accuracy"], s["mean_reasoning_tokens"], s["max_reasoning_tokens"], s["requests"]])
    table = gc.md_table(
        ["tier", "difficulty", "accuracy", "mean reasoning tokens", "max reasoning tokens", "requests"], rows
    )
    t = result["tiers"]
    budgets = {n: (x.get("thinking_budget"), x.get("max_tokens")) for n, x in ((c["name"], c) for c in tiers)}
    body = (
        f"`bench/grpo_short_tier.py` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: through the gateway "
        f"(`thinkgate eval tiers`, temperature 0), the default tiers' settings with the model swapped: `short` = "
        f"the length-penalised GRPO model `{a.model_dir}` and `short_sft` = the SFT model (`{Path(a.sft_dir).name}`), "
        f"both with the default short tier (thinking budget {budgets['short'][0]} tokens, max_tokens "
        f"{budgets['short'][1]}); `long` = the SFT model and `long_grpo` = the GRPO model with the default long tier "
        f"(budget {budgets['long'][0]}, max_tokens {budgets['long'][1]}); {a.n_per_level} held-out arith problems "
        f"per level {a.levels}, each model behind its own vLLM server (CPU build).\n\n{table}\n\n"
        + "\n".join(
            f"- {g} vs {s_}: accuracy {t[g]['accuracy']:.3f} vs {t[s_]['accuracy']:.3f}, mean reasoning tokens "
            f"{t[g]['mean_reasoning_tokens']:.1f} vs {t[s_]['mean_reasoning_tokens']:.1f} "
            f"({t[g]['mean_reasoning_tokens'] / max(1e-9, t[s_]['mean_reasoning_tokens']):.0%})."
            for g, s_ in (("short", "short_sft"), ("long_grpo", "long"))
        )
    )
    (gc.ROOT / "bench" / "results").mkdir(exist_ok=True)
    (gc.ROOT / "bench" / "results" / "grpo_short_tier.json").write_text(json.dumps(result, indent=2) + "\n")
    print(body)
    if a.write_results:
        gc.write_subsection("Short tier through the gateway", body)


if __name__ == "__main__":
    main()
