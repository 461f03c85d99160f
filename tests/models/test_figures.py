"""The README's measured tables are the recorded bench JSONs rendered, and the quick benches
tell the same story as the full ones."""

from __future__ import annotations

import json

import pytest

from genrec.models import figures
from genrec.scripts.cli import main


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    return figures.load_records()


def test_the_readme_tables_are_the_records_rendered(records):
    text = figures.README.read_text()
    for name in [*figures.TABLES, *figures.RENDERERS]:
        assert f"<!-- figures:{name} -->" in text, f"the README has no {name} table"
    assert figures.update(text, records) == text, "the README drifted from configs/figures/: genrec bench readme"
    assert main(["bench", "readme", "--check"]) == 0


def test_every_table_column_is_recorded_with_its_conditions(records):
    for columns, _ in figures.TABLES.values():
        for name in columns:
            assert name in records, f"configs/figures/{name}.json is missing"
    for name in [*figures.QUALITY_SEEDS, *figures.PROFILES]:
        assert name in records, f"configs/figures/{name}.json is missing"
    for name, record in records.items():
        c = record["conditions"]
        assert c["git_commit"] and c["cpu"]["model"] and c["versions"]["torch"], name
        assert len(c["load_average_before"]) == 3 and len(c["load_average_after"]) == 3, name
        assert c["threads"]["torch"] >= 1, name
        assert record.get("quick", False) == name.endswith("-quick"), f"{name}: quick flag and file name disagree"


def test_quick_benches_tell_the_same_story_as_the_full_ones(records):
    for bench in figures.CONSISTENT:
        assert f"{bench}-quick" in records and bench in records, f"no recorded quick/full pair for {bench}"
    assert figures.quick_vs_full(records) == []


def test_the_consistency_check_and_the_drift_check_can_fail(tmp_path, records):
    doctored = {**records, "dense-quick": {**records["dense-quick"], "jagged_vs_padded":
                                          1.5 * records["dense"]["jagged_vs_padded"]}}
    assert [p.split(":")[0] for p in figures.quick_vs_full(doctored)] == ["dense.jagged_vs_padded"]
    # A README whose table no longer matches its record fails --check, and is then rewritten.
    (tmp_path / "figures").mkdir()
    for name, record in doctored.items():
        (tmp_path / "figures" / f"{name}.json").write_text(json.dumps(record))
    readme = tmp_path / "README.md"
    readme.write_text(figures.README.read_text())
    assert figures.command(True, readme, tmp_path / "figures") == 1
    assert figures.command(False, readme, tmp_path / "figures") == 0
    assert figures.command(True, readme, tmp_path / "figures") == 0
    assert figures.cell(doctored["dense-quick"], "jagged_vs_padded") in readme.read_text()


def test_a_malformed_figures_block_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'sparse' has no closing"):
        figures.update("<!-- figures:sparse -->\nold\n", {})
    with pytest.raises(ValueError, match="unknown figures block 'nope'"):
        figures.update("<!-- figures:nope -->\n<!-- /figures:nope -->\n", {})


def test_a_cell_shows_the_spread_and_never_invents_a_figure():
    record = {"r": 0.7234, "r_spread": {"median": 0.7234, "min": 0.70, "max": 0.83, "n": 31}, "rows": 3.7e6}
    assert figures.cell(record, "r") == "0.723 [0.7, 0.83]"
    assert figures.cell(record, "rows") == "3.70M"
    assert figures.cell(record, "absent") == "-" and figures.cell(None, "r") == "-"
    assert figures.meets(0.72, ">= 0.8") == ">= 0.8 (missed)" and figures.meets(10.1, "<= 16") == "<= 16 (met)"


def test_a_strict_target_is_missed_at_its_bound():
    assert figures.meets(25.0, "< 25") == "< 25 (missed)" and figures.meets(24.9, "< 25") == "< 25 (met)"
    assert figures.meets(1.0, "< 1") == "< 1 (missed)" and figures.meets(16.0, "<= 16") == "<= 16 (met)"


def test_a_record_taken_on_a_busy_machine_says_so_under_its_table():
    record = {"conditions": {"load_average_before": [0.9], "load_average_after": [1.2], "git_commit": "abc1234"}}
    assert "noisy" not in figures.conditions("r", record)
    assert "taken noisy" in figures.conditions("r", {**record, "taken_noisy": True})
