"""Makes ``docs/dashboard.png``: the README's examples sent to ``thinkgate serve`` on embedded defaults, then the
dashboard opened with the development key in headless Chromium and photographed.

What runs: ``tests/fixtures/upstream_sim.py`` as the upstream (the vLLM engine is off — it is CPU heavy and the
figures are the gateway's, not the model's; the caption says so), ``thinkgate serve`` with no key configured
(so it creates the development key, which opens the dashboard) and the shipped router, on the Redis at
``REDIS_URL`` under a fresh key prefix (deleted afterwards). Traffic: the README's curl request (twice: the
second is a cache hit), its harder question, the OpenAI SDK examples (routed and streamed), the Responses and
Messages API examples, ``thinkgate keys create --id team-a …`` and ``thinkgate budgets set --tag team=a …``
and a few requests with that key.

    .venv/bin/python -m bench.dashboard_shot [--out docs/dashboard.png]

``--attach URL`` photographs a gateway already serving instead (e.g. ``make serve`` with the vLLM engine): the
traffic goes to it, the CLI commands run with this process's environment (so give it the same
``THINKGATE_STATE_DIR`` / ``THINKGATE_REDIS__KEY_PREFIX`` as the server), the dev key is read from
``$THINKGATE_STATE_DIR/dev-key``; nothing is started, stopped or deleted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.engine.redis_server import free_port
from tests.fixtures.browser import chromium_path, launch, log_in, wait_ready
from tests.fixtures.gateway import cleanup
from tests.fixtures.upstream import start_sim, wait_http_ok

REPO = Path(__file__).resolve().parents[1]
EASY = "Start with 6. Add 8. What is the result?"
HARD = ("Take the number 21. Decrease it by 9. Halve it. Subtract 5. Subtract 1. Increase it by 5. Divide it by 5. "
        "What do you get?")


def traffic(base: str, dev_key: str, cli: Any) -> None:
    """The README's examples, as written there (through the SDKs where the README uses them)."""
    import anthropic
    import openai

    h = {"authorization": f"Bearer {dev_key}"}
    for text in (EASY, EASY, HARD):  # curl example (twice: the second answers from the cache), the harder question
        r = httpx.post(base + "/v1/chat/completions", headers=h, timeout=30,
                       json={"model": "auto", "temperature": 0, "messages": [{"role": "user", "content": text}]})
        r.raise_for_status()
    client = openai.OpenAI(base_url=base + "/v1", api_key=dev_key)
    client.chat.completions.create(model="auto", temperature=0, messages=[
        {"role": "user", "content": "Start with 9. Multiply by 4, then subtract 6. What is the result?"}])
    for _ in client.chat.completions.create(model="long", stream=True, stream_options={"include_usage": True},
                                            temperature=0, messages=[{"role": "user", "content":
                                                                      "Start with 12. Add 3, then multiply by 2. "
                                                                      "What is the result?"}]):
        pass
    client.responses.create(model="auto", input="Start with 7. Add 5. What is the result?", temperature=0)
    claude = anthropic.Anthropic(base_url=base, api_key=dev_key)
    claude.messages.create(model="auto", max_tokens=128, thinking={"type": "enabled", "budget_tokens": 64},
                           messages=[{"role": "user", "content": "Start with 4. Multiply by 3. What is the result?"}])
    # the README's key and budget commands, then that team's traffic
    secret = cli("keys", "create", "--id", "team-a", "--tag", "team=a", "--budget-usd-day", "5", "--rpm", "600")
    cli("budgets", "set", "--tag", "team=a", "--usd-day", "50")
    team = openai.OpenAI(base_url=base + "/v1", api_key=secret)
    for i, model in enumerate(("auto", "short", "long", "auto", "none", "long")):
        team.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Start with {i + 2}. "
                                                             f"Add {i + 1}. What is the result?"}])


def shoot(base: str, dev_key: str, out: Path, executable: str) -> None:
    """Log in with ``dev_key`` in headless Chromium and photograph the whole dashboard page into ``out``."""
    from playwright.sync_api import sync_playwright

    time.sleep(1.0)  # the metering writer runs just after each response
    with sync_playwright() as p:
        browser = launch(p, executable)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            log_in(page, base, dev_key)
            wait_ready(page)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    print(f"wrote {out}")


def attach(base: str, out: Path, executable: str) -> None:
    """The README's traffic to the gateway at ``base``, then the photograph (see the module doc)."""
    from gateway.config import STATE_DIR

    dev_key = (STATE_DIR / "dev-key").read_text().strip()

    def cli(*a: str) -> str:
        r = subprocess.run([sys.executable, "-m", "gateway", *a], cwd=REPO, capture_output=True, text=True,
                           timeout=120, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        return r.stdout.strip()

    traffic(base, dev_key, cli)
    shoot(base, dev_key, out, executable)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    ap.add_argument("--attach", metavar="URL", help="a gateway already serving (see the module doc)")
    args = ap.parse_args()
    executable = chromium_path()
    if executable is None:
        sys.exit("no Chromium: apt-get install chromium")
    if args.attach:
        attach(args.attach.rstrip("/"), args.out, executable)
        return

    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

    prefix = f"tg-shot-{uuid.uuid4().hex[:8]}:"
    sim = start_sim()
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        from gateway.config import Settings

        tiers = [{**t.model_dump(mode="json"), "base_url": sim.base_url, "model": "sim-model"}
                 for t in Settings.load(None).tiers]
        cfg = {"engine": {"enabled": False}, "tiers": tiers,
               "redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False},
               "dashboard": {"poll_s": 2}}
        config = Path(tmp) / "thinkgate.yaml"
        config.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "THINKGATE_STATE_DIR": str(state), "PYTHONPATH": str(REPO), "THINKGATE_CONFIG": ""}
        port = free_port()

        def cli(*a: str) -> str:
            r = subprocess.run([sys.executable, "-m", "gateway", *a, "--config", str(config)], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=60, check=True)
            return r.stdout.strip()

        try:
            proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port",
                                     str(port)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                    stderr=(Path(tmp) / "serve.log").open("w"))
            base = f"http://127.0.0.1:{port}"
            wait_http_ok(base + "/health", timeout_s=120, proc=proc)
            dev_key = (state / "dev-key").read_text().strip()
            traffic(base, dev_key, cli)
            shoot(base, dev_key, args.out, executable)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
            sim.stop()
            cleanup(redis_url, prefix)


if __name__ == "__main__":
    main()
