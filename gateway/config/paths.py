"""Where the shipped files are: the router (package data), the local model (a source checkout's ``models/``,
not in the wheel) and the gateway's local state directory.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

#: The source checkout's ``models/`` folder: the tiny reasoning models the embedded dev engine serves and training
#: starts from. Data of the checkout, not of the product: the wheel carries no models (nor the ``training``
#: package), so in a wheel install this path does not exist and the engine needs ``engine.model_path``.
MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
#: The model the embedded dev engine serves by default (``engine.model_path``).
DEFAULT_MODEL_DIR = MODELS_DIR / "thinkgate-tiny"


def missing_model(model_dir: Path) -> str | None:
    """None when ``model_dir`` holds a Hugging Face model (its ``config.json``), else one line saying so and how
    to fix it (a wheel install ships no model: point ``engine.model_path`` at one, run from a source checkout, or
    turn the engine off and point the tiers at external servers)."""
    if (Path(model_dir) / "config.json").is_file():
        return None
    return (f"no model for the embedded engine at {model_dir} (a wheel install ships none): set "
            "THINKGATE_ENGINE__MODEL_PATH (engine.model_path) to a Hugging Face model directory, run from a source "
            "checkout (models/), or set THINKGATE_ENGINE__ENABLED=false and point the tiers at your vLLM servers")


#: The shipped difficulty router (package data of ``router``; the distribution is installed unzipped — a wheel or
#: an editable checkout — so the traversable is a real path; the lookup imports only ``router/__init__``).
DEFAULT_ROUTER_PATH = Path(str(files("router").joinpath("assets", "default.skops")))


#: Where the gateway keeps local state (dev key, usage spool, engine caches): ``$THINKGATE_STATE_DIR``, else
#: ``.thinkgate/`` in the working directory — never inside site-packages.
STATE_DIR = Path(os.environ.get("THINKGATE_STATE_DIR") or Path.cwd() / ".thinkgate")

