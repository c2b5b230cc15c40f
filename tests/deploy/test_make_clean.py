"""``make clean`` deletes what was built, never the gateway's state; ``make clean-state`` refuses while a spool
still holds records (deleting them would lose usage), unless ``FORCE=1``. Run on a scratch folder with the
repository's own Makefile."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def _make(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-f", str(MAKEFILE), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)


def _state(root: Path, spool_line: str) -> Path:
    """A checkout's built and kept files: a virtualenv, engine caches, Redis data, the key and a usage spool."""
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".thinkgate" / "engine").mkdir(parents=True)
    (root / ".thinkgate" / "engine" / "vllm-8001.log").write_text("log\n")
    (root / ".thinkgate" / "redis" / "6379").mkdir(parents=True)
    (root / ".thinkgate" / "redis" / "6379" / "appendonly.aof").write_text("*1\r\n")
    (root / ".thinkgate" / "dev-key").write_text("tg-dev\n")
    spool = root / ".thinkgate" / "usage-spool.jsonl"
    spool.write_text(spool_line)
    return spool


def test_clean_keeps_the_gateways_state(tmp_path: Path) -> None:
    spool = _state(tmp_path, '{"event_id": "e1", "cost_micro_usd": 7}\n')
    done = _make(tmp_path, "clean")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / ".venv").exists()
    assert not (tmp_path / ".thinkgate" / "engine").exists()
    # keys, budgets and usage in the Redis file, the unsent usage event and the key are data, not build output
    assert (tmp_path / ".thinkgate" / "redis" / "6379" / "appendonly.aof").exists()
    assert spool.read_text() == '{"event_id": "e1", "cost_micro_usd": 7}\n'
    assert (tmp_path / ".thinkgate" / "dev-key").exists()


def test_clean_state_refuses_while_a_spool_holds_records(tmp_path: Path) -> None:
    spool = _state(tmp_path, '{"event_id": "e1", "cost_micro_usd": 7}\n')
    refused = _make(tmp_path, "clean-state")
    assert refused.returncode != 0
    assert "usage-spool.jsonl" in refused.stderr and "FORCE=1" in refused.stderr
    assert spool.exists()
    forced = _make(tmp_path, "clean-state", "FORCE=1")
    assert forced.returncode == 0, forced.stderr
    assert not (tmp_path / ".thinkgate").exists()


def test_clean_state_deletes_when_every_spool_is_empty(tmp_path: Path) -> None:
    _state(tmp_path, "")
    done = _make(tmp_path, "clean-state")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / ".thinkgate").exists() and not (tmp_path / ".venv").exists()
