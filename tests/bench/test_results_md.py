"""bench/RESULTS.md sections: a script rewrites only its own, and with ``keep_history`` the previous run stays."""

from __future__ import annotations

from pathlib import Path

from bench._lib.results_md import write_section


def test_a_section_is_replaced_and_the_others_kept(tmp_path: Path) -> None:
    p = tmp_path / "R.md"
    p.write_text("# Benchmark results\n\n## A\n\nold a\n\n## B\n\nb\n")
    write_section("## A", "## A\n\nnew a\n", p)
    assert p.read_text() == "# Benchmark results\n\n## A\n\nnew a\n\n## B\n\nb\n"
    write_section("## C", "## C\n\nc\n", p)
    assert p.read_text().endswith("## B\n\nb\n\n## C\n\nc\n")


def test_keep_history_puts_the_previous_run_under_earlier_run(tmp_path: Path) -> None:
    p = tmp_path / "R.md"
    p.write_text("# Benchmark results\n\n## A\n\nrun 1\n\n## B\n\nb\n")
    write_section("## A", "## A\n\nrun 2\n", p, keep_history=True)
    write_section("## A", "## A\n\nrun 3\n", p, keep_history=True)
    text = p.read_text()
    assert text.index("run 3") < text.index("run 2") < text.index("run 1") < text.index("## B")
    assert text.count("### Earlier run") == 2 and text.endswith("## B\n\nb\n")
