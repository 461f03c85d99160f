"""The overwrite rule of `claim_output_dir`: what it refuses, naming the path, before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from genrec.data.files import claim_output_dir

MANIFEST = "m.json"


def _genrec_output(out: Path) -> None:
    """An output of kind "x/1" whose manifest lists a top-level file and one in a subfolder."""
    (out / "sub").mkdir(parents=True)
    (out / "a.parquet").write_text("a")
    (out / "sub" / "b.parquet").write_text("b")
    (out / MANIFEST).write_text(json.dumps({"format": "x/1", "files": ["a.parquet", "sub/b.parquet"]}))


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


INTRUDERS = {
    # A link to a folder (its target's files survived, the link did not) and an empty
    # folder were deleted by --overwrite without a word.
    "link to a folder": (lambda out, mine: (out / "link").symlink_to(mine, target_is_directory=True), "link"),
    "link in a listed folder": (lambda out, mine: (out / "sub" / "link").symlink_to(mine), "sub/link"),
    "empty folder": (lambda out, mine: (out / "empty").mkdir(), "empty"),
    "link to a file": (lambda out, mine: (out / "f").symlink_to(mine / "keep.txt"), "f"),
    "file in a listed folder": (lambda out, mine: (out / "sub" / "notes.txt").write_text("x"), "sub/notes.txt"),
    "folder of files": (lambda out, mine: ((out / "d").mkdir(), (out / "d" / "x").write_text("x")), "d"),
}


@pytest.mark.parametrize("case", sorted(INTRUDERS))
def test_overwrite_refuses_anything_the_manifest_does_not_list(tmp_path, case):
    add, shown = INTRUDERS[case]
    out, mine = tmp_path / "out", tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("keep")
    _genrec_output(out)
    assert claim_output_dir(out, overwrite=True, manifest=MANIFEST, format="x/1") == out
    add(out, mine)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=rf"does not list \({shown}\)"):
        claim_output_dir(out, overwrite=True, manifest=MANIFEST, format="x/1")
    assert _tree(tmp_path) == before


def test_a_file_in_place_of_a_parent_is_refused_up_front(tmp_path):
    """It passed the check, and `genrec eval --out afile/rep` failed after the evaluation."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=rf"{tmp_path}/afile/rep/deeper cannot be made: {tmp_path}/afile is a file"):
        claim_output_dir(tmp_path / "afile" / "rep" / "deeper", overwrite=False, manifest=MANIFEST)
    assert claim_output_dir(tmp_path / "new" / "rep", overwrite=False, manifest=MANIFEST) == tmp_path / "new" / "rep"


def test_the_claimed_path_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert claim_output_dir(".", overwrite=False, manifest=MANIFEST) == tmp_path
    assert claim_output_dir("x/", overwrite=False, manifest=MANIFEST) == tmp_path / "x"
    assert claim_output_dir("x/..", overwrite=False, manifest=MANIFEST) == tmp_path
