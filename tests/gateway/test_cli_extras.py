"""A command whose optional extra is missing ends with one line naming the extra (exit 2), not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from router.errors import MissingExtra, ThinkGateError, install_hint, require

REPO = Path(__file__).resolve().parents[2]


def test_require_names_the_extra() -> None:
    with pytest.raises(MissingExtra) as info:
        require("thinkgate_no_such_module.sub", "report", "thinkgate usage export --format parquet")
    assert str(info.value) == (
        "thinkgate usage export --format parquet needs thinkgate_no_such_module; install the 'report' extra: "
        "pip install '<the thinkgate wheel or checkout>[report]'"
    )
    assert isinstance(info.value, ThinkGateError) and isinstance(info.value, ImportError)
    assert require("json", "eval", "x").dumps([1]) == "[1]"


def test_install_hint_names_the_wheel_or_checkout_not_an_index() -> None:
    """ThinkGate is on no package index: ``pip install 'thinkgate[report]'`` (the old hint) asks one for a project
    it cannot find. Every hint points pip at what ThinkGate was installed from — the wheel file or the checkout — as
    README "Install the product alone" says, and carries the extra's name."""
    assert install_hint("report") == \
        "install the 'report' extra: pip install '<the thinkgate wheel or checkout>[report]'"
    assert install_hint() == "install thinkgate: pip install '<the thinkgate wheel or checkout>'"
    readme = (REPO / "README.md").read_text()
    assert "install the 'report' extra: pip install '<the thinkgate wheel or checkout>[report]'" in readme
    assert "'dist/thinkgate-0.1.0-py3-none-any.whl[report]'" in readme and "'.[report]'" in readme
    for hint in (install_hint("otel"), install_hint()):
        assert "'thinkgate[" not in hint and "pip install thinkgate" not in hint


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
        "thinkgate usage export --format parquet needs pyarrow; install the 'report' extra: "
        "pip install '<the thinkgate wheel or checkout>[report]'\n"
    )


def test_train_without_torch_says_install_train(tmp_path: Path) -> None:
    help_ = _cli_without("torch", "train", "tiny", "--help", tmp=tmp_path)
    assert help_.returncode == 0, help_.stderr  # --help never needs the extra
    r = _cli_without("torch", "train", "tiny", "--output-dir", str(tmp_path / "m"), tmp=tmp_path)
    assert (r.returncode, r.stderr) == (2, "thinkgate train tiny needs torch; install the 'train' extra: "
                                           "pip install '<the thinkgate wheel or checkout>[train]'\n")


def _wheel_only_cli(*argv: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """A real ``thinkgate`` process that sees what a wheel install holds: ``gateway`` and ``router`` (linked into a
    scratch folder), not the checkout's ``training`` and ``bench`` — its folder is taken off ``sys.path`` (the
    editable install's .pth puts it there; ``-I`` drops PYTHONPATH and the working directory). The entry points
    still name ``training.cli`` and ``bench.cli``, as the wheel's do."""
    site = tmp / "wheel-site"
    site.mkdir(exist_ok=True)
    for pkg in ("gateway", "router"):
        if not (site / pkg).exists():
            (site / pkg).symlink_to(REPO / pkg, target_is_directory=True)
    code = textwrap.dedent(f"""
        import os, sys
        sys.path[:] = [{str(site)!r}] + [p for p in sys.path if p and os.path.realpath(p) != {str(REPO)!r}]
        sys.argv = ["thinkgate", *{list(argv)!r}]
        from gateway.cli.main import main
        main()
    """)
    env = {**os.environ, "THINKGATE_STATE_DIR": str(tmp / "state")}
    return subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp)


@pytest.mark.parametrize("group, argv", [
    ("train", ()), ("train", ("tiny",)), ("train", ("--help",)), ("train", ("grpo", "--allow-dirty")),
    ("bench", ("traces", "--help")), ("bench", ("--help",)),
])
def test_a_missing_plugin_group_answers_every_invocation_with_its_hint(group: str, argv: tuple[str, ...],
                                                                       tmp_path: Path) -> None:
    """Without the checkout's ``training``/``bench`` (a wheel install), ``thinkgate train tiny`` and ``thinkgate
    bench --help`` print the same one line as bare ``thinkgate train`` (exit 2) — they printed click's "No such
    command 'tiny'": the stand-in group had no commands and click resolves one before the group's callback runs."""
    r = _wheel_only_cli(group, *argv, tmp=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"thinkgate {group}: unavailable here ("), r.stderr
    assert "No module named" in lines[0] and "run it from a source checkout" in lines[0], r.stderr
    assert r.stdout == ""


def test_a_missing_plugin_group_is_still_listed_by_help(tmp_path: Path) -> None:
    r = _wheel_only_cli("--help", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Offline training jobs" in r.stdout and "Benchmarks of the whole stack" in r.stdout, r.stdout
