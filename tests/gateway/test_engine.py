"""LocalEngine's process handling, with real subprocesses standing in for vLLM (no model needed).

The stand-ins are real executables given as ``python=``: they receive the exact vLLM argv and environment.
The real vLLM server is exercised in ``test_engine_vllm.py``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import DEFAULT_MODEL_DIR, EngineConfig
from gateway.engine.vllm import EngineError, LocalEngine
from tests.fixtures.ports import lease_port, release_port

FAKE_SERVER = f"""#!{sys.executable}
# Answers GET /health like vLLM once up; records its argv and environment.
import http.server, json, os, sys
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
with open(os.environ["FAKE_RECORD"], "w") as fh:
    json.dump({{"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}}, fh)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _script(tmp_path: Path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text(body)
    p.chmod(0o755)
    return str(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie counts as dead
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.fixture(autouse=True)
def _leases() -> Iterator[list[int]]:
    """The ports :func:`_cfg` leased in this test, given back after it."""
    _LEASED.clear()
    yield _LEASED
    for port in _LEASED:
        release_port(port)
    _LEASED.clear()


_LEASED: list[int] = []


def _cfg(**kw: object) -> EngineConfig:
    """An engine config on a port leased until the test ends (:mod:`tests.fixtures.ports`)."""
    _LEASED.append(lease_port())
    return EngineConfig(**{"model_path": DEFAULT_MODEL_DIR, **kw}, port=_LEASED[-1])  # type: ignore[arg-type]


def test_command_and_environment() -> None:
    cfg = _cfg(extra_args=["--max-num-seqs", "8"], kv_cache_gib=2, cpu_threads_bind="0")
    eng = LocalEngine(cfg, state_dir=Path("/tmp/tg-state"))
    cmd = eng.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in [("--served-model-name", "thinkgate-tiny"), ("--host", "127.0.0.1"),
                        ("--port", str(cfg.port)), ("--dtype", "float32"), ("--reasoning-parser", "qwen3"),
                        ("--max-model-len", "2048"), ("--model", str(DEFAULT_MODEL_DIR.resolve()))]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enforce-eager" in cmd and cmd[-2:] == ["--max-num-seqs", "8"]
    env = eng.environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CACHE_ROOT"].startswith("/tmp/tg-state/engine")
    assert env["HF_HOME"].startswith("/tmp/tg-state/engine")
    assert eng.base_url == f"http://127.0.0.1:{cfg.port}/v1"


def test_start_waits_for_health_then_stop_kills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_RECORD", str(record))
    eng = LocalEngine(_cfg(), state_dir=tmp_path / "state", python=_script(tmp_path, "fake", FAKE_SERVER))
    with eng:
        assert eng.running and eng.startup_s is not None
        assert httpx.get(eng.base_url.removesuffix("/v1") + "/health", trust_env=False).status_code == 200
        seen = json.loads(record.read_text())
        assert seen["argv"][:2] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1" and seen["env"]["HF_HUB_OFFLINE"] == "1"
        pid = eng.pid
        assert pid is not None
        eng.start()  # idempotent while running
        assert eng.pid == pid
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid) and not eng.running
    eng.stop()  # idempotent


def test_exit_during_startup_raises_with_log_tail(tmp_path: Path) -> None:
    bad = _script(tmp_path, "bad", "#!/bin/sh\necho 'ValueError: no such model: boom-marker' >&2\nexit 3\n")
    eng = LocalEngine(_cfg(), state_dir=tmp_path, python=bad)
    with pytest.raises(EngineError) as err:
        eng.start()
    assert "status 3" in str(err.value) and "boom-marker" in str(err.value)
    assert not eng.running


def test_startup_timeout_kills_the_process_group(tmp_path: Path) -> None:
    # the stand-in forks a child (like vLLM's engine core) and never becomes healthy
    hang = _script(tmp_path, "hang", f"#!/bin/sh\nsleep 300 &\necho $! > {tmp_path}/child\nexec sleep 300\n")
    eng = LocalEngine(_cfg(startup_timeout_s=1.5), state_dir=tmp_path, python=hang)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="not healthy after"):
        eng.start()
    assert time.monotonic() - t0 < 30
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the engine's child process survived stop()"


def test_missing_model_and_busy_port_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"no config\.json"):
        LocalEngine(_cfg(model_path=tmp_path / "nowhere"), state_dir=tmp_path).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EngineError, match="already in use"):
            LocalEngine(EngineConfig(model_path=DEFAULT_MODEL_DIR, port=port), state_dir=tmp_path).start()
