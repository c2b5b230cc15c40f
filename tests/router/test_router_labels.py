"""Label sources 1 (dataset difficulty) and 2 (outcome pairs) on small fixtures and on the real data files,
plus the JSONL schema and the `thinkgate router label …` commands."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.cli.main import app
from router.fit.jsonl import read_jsonl, sha256_rows, write_jsonl
from router.fit.labels import LabelledItem, from_difficulty, from_outcome_pairs, load_items

REPO = Path(__file__).resolve().parents[2]
MMLU = REPO / "data" / "routellm" / "mmlu_responses.jsonl.gz"
WEAK, STRONG = "mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"

MATH_ROWS = [
    {"problem": "What is $1+1$?", "level": 1, "subject": "Prealgebra", "unique_id": "a"},
    {"problem": "Solve $x^2=4$.", "level": 3, "subject": "Algebra", "unique_id": "b"},
    {"problem": "Prove that $\\sqrt 2$ is irrational.", "level": 4, "subject": "Number Theory", "unique_id": "c"},
    {"problem": "Count lattice paths.", "level": 5, "subject": "Counting & Probability", "unique_id": "d"},
    {"problem": "Level ? problem", "level": None, "subject": "Geometry", "unique_id": "e"},
]
PAIR_ROWS = [
    {"subject": "s1", "prompt": "both right", WEAK: True, STRONG: True},
    {"subject": "s1", "prompt": "only strong", WEAK: False, STRONG: True},
    {"subject": "s2", "prompt": "only weak", WEAK: True, STRONG: False},
    {"subject": "s2", "prompt": "both wrong", WEAK: False, STRONG: False},
]


def test_source1_difficulty_threshold_groups_and_nulls() -> None:
    items = list(from_difficulty(MATH_ROWS, threshold=4, source="math-level"))
    assert [it.id for it in items] == ["a", "b", "c", "d"]  # null level skipped
    assert [it.label for it in items] == [0, 0, 1, 1]
    assert items[2].group == "Number Theory" and items[2].source == "math-level>=4"
    assert items[3].meta == {"difficulty": 5}
    assert [it.label for it in from_difficulty(MATH_ROWS, threshold=3)] == [0, 1, 1, 1]
    nested = [{"q": "x", "meta": {"ops": 6}}, {"q": "y", "meta": {"ops": 2}}]
    got = list(from_difficulty(nested, threshold=4, text_field="q", difficulty_field="meta.ops", group_field=None,
                               id_field=None))
    assert [(it.id, it.label) for it in got] == [("0", 1), ("1", 0)]


def test_source2_outcome_pairs() -> None:
    items = list(from_outcome_pairs(PAIR_ROWS, weak_field=WEAK, strong_field=STRONG, id_prefix="m/"))
    assert [it.label for it in items] == [0, 1, 0, 0]
    assert [(it.short_correct, it.long_correct) for it in items] == [(True, True), (False, True), (True, False),
                                                                      (False, False)]
    assert [it.group for it in items] == ["s1", "s1", "s2", "s2"] and items[1].id == "m/1"


def test_routellm_mmlu_file_gives_the_published_label_balance() -> None:
    items = list(from_outcome_pairs(read_jsonl(MMLU), weak_field=WEAK, strong_field=STRONG))
    assert len(items) == 14_042 and len({it.group for it in items}) == 57
    assert sum(it.label for it in items) == 2_497  # "only GPT-4 correct" in shared/data/README.md


def test_jsonl_roundtrip_schema_errors_and_hash(tmp_path: Path) -> None:
    items = list(from_outcome_pairs(PAIR_ROWS, weak_field=WEAK, strong_field=STRONG))
    p = tmp_path / "x.jsonl.gz"
    write_jsonl(p, (it.to_dict() for it in items))
    with gzip.open(p, "rt") as f:
        assert len(f.readlines()) == 4
    back = load_items([p])
    assert back == items
    assert sha256_rows(it.to_dict() for it in back) == sha256_rows(it.to_dict() for it in items)
    with pytest.raises(ValueError, match="duplicate id"):
        load_items([p, p])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "text": "t", "label": 2}\n')
    with pytest.raises(ValueError, match="label must be 0 or 1"):
        load_items([bad])
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_items([bad])
    with pytest.raises(ValueError, match="lacks 'text'"):
        LabelledItem.from_dict({"id": "1", "label": 0})


def test_label_cli_difficulty_and_outcomes(tmp_path: Path) -> None:
    runner = CliRunner()
    src = tmp_path / "math.jsonl"
    write_jsonl(src, MATH_ROWS)
    out = tmp_path / "math-labels.jsonl"
    r = runner.invoke(app, ["router", "label", "difficulty", str(src), str(out), "--threshold", "4"])
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["label"] for line in out.read_text().splitlines()] == [0, 0, 1, 1]
    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(pairs, PAIR_ROWS)
    out2 = tmp_path / "pair-labels.jsonl"
    r = runner.invoke(app, ["router", "label", "outcomes", str(pairs), str(out2)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out2.read_text().splitlines()]
    assert [row["label"] for row in rows] == [0, 1, 0, 0] and rows[0]["source"] == "routellm-mmlu"
    tasks = tmp_path / "arith.jsonl"
    r = runner.invoke(app, ["router", "label", "export-task", "arith", "test", str(tasks), "--n", "3",
                            "--difficulties", "1,5"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    assert [row["difficulty"] for row in rows] == [1, 1, 1, 5, 5, 5]
    assert {"id", "question", "answer", "task"} <= set(rows[0]) and rows[0]["task"] == "arith"
