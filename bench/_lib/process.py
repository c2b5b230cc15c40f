"""Stopping a child process: a signal (SIGTERM: let it shut down cleanly), a wait, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout_s: float = 15.0,
                 kill_timeout_s: float = 10.0) -> None:
    """Send ``sig`` to ``proc`` and wait ``timeout_s`` seconds for it to exit; past that SIGKILL it and wait
    ``kill_timeout_s`` more (``subprocess.TimeoutExpired`` if even that does not end it). Nothing to do when
    ``proc`` is None or has already exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=kill_timeout_s)
