"""Files that survive a crash: what a rename needs beyond ``os.replace`` (the spools, the router copies a gateway
adopts). In the lowest package so every package may use it."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush directory ``path`` to disk: a file renamed into it (``os.replace``) keeps its new name after a crash or
    power loss only once its directory entry is on disk. Raises ``OSError`` as ``os.open``/``os.fsync`` do."""
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
