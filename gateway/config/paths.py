"""Where the shipped files are: the router (package data), the local model (a checkout's ``models/``) and
the gateway's local state directory.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path


def _shipped(package: str, *parts: str) -> Path:
    """A file shipped inside an installed package (``importlib.resources``), as a filesystem path.

    The distribution is installed unzipped (a wheel or an editable checkout), so the traversable is a real path.
    The lookup imports only the package's ``__init__`` (a docstring), never its modules.
    """
    return Path(str(files(package).joinpath(*parts)))


#: The shipped local reasoning model that the embedded dev engine serves (a training product, found as package data).
DEFAULT_MODEL_DIR = _shipped("training", "assets", "thinkgate-tiny")


#: The shipped difficulty router.
DEFAULT_ROUTER_PATH = _shipped("router", "assets", "default.skops")


#: Where the gateway keeps local state (dev key, usage spool, engine caches): ``$THINKGATE_STATE_DIR``, else
#: ``.thinkgate/`` in the working directory — never inside site-packages.
STATE_DIR = Path(os.environ.get("THINKGATE_STATE_DIR") or Path.cwd() / ".thinkgate")

