"""What the import contracts cannot see (issue 23).

1. ``import gateway.app`` and building the app on the default settings load nothing from ``training`` (nor
   torch, vLLM, bench or tests): checked in a fresh interpreter, whose ``sys.modules`` is the evidence (this
   test process has imported them already). A ``files("training")`` or a stray import in the serving path fails.
2. Every dynamic import in ``gateway/`` and ``router/`` — ``importlib.import_module``, ``__import__``,
   ``importlib.resources.files`` (it imports the package it names) and entry-point loading — is one of the
   listed ones below: a new one fails here until it is added to the list with its reason (or made static, where
   lint-imports sees it).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {"training", "torch", "vllm", "transformers", "trl", "bench", "tests"}

PROBE = """
import json, sys
import gateway.app
from gateway.app import create_app
from gateway.config import Settings

create_app(Settings.load(None, redis={"url": "redis://127.0.0.1:1/0", "start_if_missing": False}))
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_import_gateway_app_and_building_it_load_no_training_torch_or_vllm(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("THINKGATE_")}
    env.update(PYTHONPATH=str(REPO), THINKGATE_STATE_DIR=str(tmp_path / "state"))
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "gateway" in loaded and "router" in loaded
    assert not loaded & FORBIDDEN, sorted(loaded & FORBIDDEN)


#: (file, call, what it names) of every dynamic import in gateway/ and router/, each with its reason
DYNAMIC_IMPORTS = {
    # the shipped router file, as package data of `router` (imports router/__init__ only)
    ("gateway/config/paths.py", "files", "router"),
    # the dashboard's static HTML/JS/CSS (package data)
    ("gateway/api/dashboard/__init__.py", "files", "gateway.api.dashboard"),
    # `thinkgate router|train|bench` plug-ins (a missing one answers which install it needs)
    ("gateway/cli/main.py", "entry_points", "thinkgate.cli"),
    # require(module, extra, what): an optional library by name, to say which extra is missing
    ("router/errors.py", "import_module", "<variable>"),
    # the gsm8k/MATH test splits (package data of router.tasks)
    ("router/tasks/datasets.py", "files", "router.tasks"),
    ("router/fit/default.py", "files", "router.tasks"),
    # `module:function` verifier plug-ins named in a config
    ("router/tasks/verifiers.py", "import_module", "<variable>"),
}
_CALLS = {"import_module", "__import__", "files", "entry_points"}


def _target(call: ast.Call) -> str:
    for arg in [*call.args[:1], *(k.value for k in call.keywords if k.arg in ("name", "group", "package"))]:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return "<variable>"


def dynamic_imports() -> set[tuple[str, str, str]]:
    """(file relative to the repo, call name, its literal target or ``<variable>``) for gateway/ and router/."""
    found = set()
    for root in ("gateway", "router"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in _CALLS:
                    found.add((path.relative_to(REPO).as_posix(), name, _target(node)))
    return found


def test_every_dynamic_import_is_listed() -> None:
    found = dynamic_imports()
    new = found - DYNAMIC_IMPORTS
    assert not new, f"new dynamic imports (make them static, or list them): {new}"
    assert not DYNAMIC_IMPORTS - found, f"listed but gone (drop them from the list): {DYNAMIC_IMPORTS - found}"
