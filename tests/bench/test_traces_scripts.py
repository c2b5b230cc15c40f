"""The offline trace scripts (``python -m bench.traces.calibrate_abstention``, ``bench.traces.served_offline``,
``bench.router_traces``) on a folder that is not there, or has no traces: one line, exit 2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench import router_traces
from bench.traces import calibrate_abstention, served_offline

MAINS: dict[str, Callable[[list[str]], None]] = {"calibrate_abstention": calibrate_abstention.main,
                                                 "served_offline": served_offline.main,
                                                 "router_traces": router_traces.main}


@pytest.mark.parametrize("name", sorted(MAINS))
def test_a_missing_traces_folder_is_one_line_exit_2(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    """It printed "0 answers" and exited 0 (calibrate_abstention), or a FileNotFoundError traceback (the others)."""
    with pytest.raises(SystemExit) as exc:
        MAINS[name](["--traces", str(tmp_path / "nonexistent")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such folder" in err and "nonexistent" in err


def test_a_folder_without_the_ladders_data_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    for main in MAINS.values():
        with pytest.raises(SystemExit) as exc:
            main(["--traces", str(tmp_path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
