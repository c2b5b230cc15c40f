"""Child processes that do not outlive ``thinkgate serve``.

``serve`` starts a private ``redis-server`` and the local vLLM engine in sessions of their own (so a terminal's Ctrl-C
reaches the gateway first, and the gateway stops them after its shutdown). A gateway that is SIGKILLed (the OOM
killer, ``kill -9``, a container runtime's timeout) runs no ``finally``: its children used to live on — the engine
holding its port and gigabytes of memory, so the next ``make serve`` refused to start ("port … is already in use").
On Linux a child started with :func:`popen_options` is sent SIGTERM by the kernel when the thread that started it
dies (``prctl(PR_SET_PDEATHSIG)``, prctl(2)); SIGTERM is each server's graceful stop (Redis flushes its append-only
file first). Elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

#: prctl(2) option: the signal the calling process gets when its parent (thread) dies
PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl: Callable[..., int] = libc.prctl
        return prctl
    except (OSError, AttributeError):
        return None


# Resolved once in the parent: the function that runs in the forked child (before exec) must not import or load
# anything (another thread of the parent may hold a lock the child would inherit held).
_PRCTL = _prctl()


def _die_with_parent() -> None:
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def popen_options() -> dict[str, Any]:
    """``subprocess.Popen`` keyword arguments that stop the child (SIGTERM) when this process dies, however it
    dies. Only from the main thread: the kernel signals the child when the *thread* that forked it exits, and a
    worker thread may end long before the process. Empty off Linux or from another thread."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return {}
    return {"preexec_fn": _die_with_parent}
