""":func:`gateway.engine.children.popen_options`: a child started with it stops when its starter is SIGKILLed (the
local engine and the private Redis of ``serve``), and a worker thread gets no such option (the kernel would stop
the child when that thread ends)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway.engine.children import popen_options

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# a parent that starts a long sleep in a session of its own (as serve starts the engine), prints its pid, waits
STARTER = """
import subprocess, sys, time
from gateway.engine.children import popen_options
child = subprocess.Popen(["sleep", "60"], start_new_session=True, **popen_options())
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_child_stops_when_its_starter_is_sigkilled() -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parents[2])
    child_pid = None
    try:
        assert starter.stdout is not None
        child_pid = int(starter.stdout.readline())
        assert Path(f"/proc/{child_pid}").exists()
        starter.kill()
        starter.wait(timeout=10)
        deadline = time.monotonic() + 10
        # the orphan is reaped by init (or a subreaper); until then it may linger as a zombie
        while time.monotonic() < deadline and _alive(child_pid):
            time.sleep(0.02)
        assert not _alive(child_pid), "the child outlived its SIGKILLed starter"
    finally:
        if starter.poll() is None:
            starter.kill()
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def test_no_death_signal_from_a_worker_thread() -> None:
    seen: list[dict[str, object]] = []
    t = threading.Thread(target=lambda: seen.append(popen_options()))
    t.start()
    t.join()
    assert seen == [{}]
    assert "preexec_fn" in popen_options()
