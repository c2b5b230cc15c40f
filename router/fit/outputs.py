"""Output paths checked before the work that fills them: a fit or a bench run takes seconds to minutes, and a path
that cannot be written should fail first, in one line, not as a traceback after the work is done."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def output_problem(path: Path, *, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written, in a phrase naming it, or None when it can.

    ``folder=False``: ``path`` is one file (it may exist, but not as a folder); ``folder=True``: a folder that files
    go into (it may exist, but not as a file). Missing parents are fine when they can be created: the nearest
    existing ancestor must be a folder in which a file can actually be created — probed with a temporary file
    (removed at once), since permission bits say nothing for root or on read-only and virtual file systems
    (``/proc``). Creates nothing that stays."""
    if path.is_dir() and not folder:
        return f"{path} is a folder; give a file name"
    if path.exists() and not path.is_dir() and folder:
        return f"{path} is a file; several outputs need a folder"
    base = path if folder else path.parent
    while not base.exists() and base != base.parent:  # the nearest ancestor there is (the root always is)
        base = base.parent
    if not base.is_dir():
        return f"cannot create {path}: {base} is not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".thinkgate-probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write {path}: no file can be created in {base} ({exc.strerror or exc})"
    return None
