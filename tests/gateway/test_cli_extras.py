"""A command whose optional extra is missing ends with one line naming the extra (exit 2), not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from router.errors import MissingExtra, ThinkGateError, require

REPO = Path(__file__).resolve().parents[2]


def test_require_names_the_extra() -> None:
    with pytest.raises(MissingExtra) as info:
        require("thinkgate_no_such_module.sub", "report", "thinkgate usage export --format parquet")
    assert str(info.value) == (
        "thinkgate usage export --format parquet needs thinkgate_no_such_module: pip install 'thinkgate[report]'"
    )
    assert isinstance(info.value, ThinkGateError) and isinstance(info.value, ImportError)
    assert require("json", "eval", "x").dumps([1]) == "[1]"


def _cli_without(blocked: str, *argv: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    # A real `thinkgate` process in which ``blocked`` cannot be imported (as in a base install).
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == {blocked!r} or name.startswith({blocked!r} + "."):
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, Block())
        sys.argv = ["thinkgate", *{list(argv)!r}]
        from gateway.cli.main import main
        main()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "THINKGATE_STATE_DIR": str(tmp)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp)


def test_parquet_export_without_pyarrow_says_install_report(tmp_path: Path) -> None:
    r = _cli_without("pyarrow", "usage", "export", "--format", "parquet", "-o", str(tmp_path / "u.parquet"),
                     tmp=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        "thinkgate usage export --format parquet needs pyarrow: pip install 'thinkgate[report]'\n"
    )


def test_train_without_torch_says_install_train(tmp_path: Path) -> None:
    help_ = _cli_without("torch", "train", "tiny", "--help", tmp=tmp_path)
    assert help_.returncode == 0, help_.stderr  # --help never needs the extra
    r = _cli_without("torch", "train", "tiny", "--output-dir", str(tmp_path / "m"), tmp=tmp_path)
    assert (r.returncode, r.stderr) == (2, "thinkgate train tiny needs torch: pip install 'thinkgate[train]'\n")
