"""The overwrite rule of `claim_output_dir`: what it refuses, naming the path, before any work;
and the hidden folders a killed writer leaves, removed by the next writer of that output."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from genrec.data.files import claim_output_dir, remove_abandoned

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


def _hidden(tmp_path: Path, name: str) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{name}."))


def test_a_writer_killed_mid_write_leaves_nothing_the_next_one_keeps(tmp_path):
    # kill -9 while synth fills its staging folder: the next writer of that output removes
    # the folder (it held a part of the log), and the output is written whole. The log is
    # 20 parts long so that the writer is still at work when its first part appears.
    args = [sys.executable, "-m", "genrec.scripts.cli", "synth", "--out", str(tmp_path / "logs"),
            "--users", "20000", "--items", "5000", "--events", "20000000", "--seed", "1"]
    writer = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any(p.is_file() for p in tmp_path.glob(".logs.tmp-*/*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert writer.poll() is None, "the writer ended before it could be killed mid-write"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    left = _hidden(tmp_path, "logs")
    assert len(left) == 1 and str(writer.pid) in left[0], left
    assert not (tmp_path / "logs").exists()

    again = subprocess.run(args[:-6] + ["--users", "50", "--items", "80", "--events", "2000", "--seed", "1"],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert f"removing {tmp_path / left[0]}: left unfinished by process {writer.pid}" in again.stderr
    assert _hidden(tmp_path, "logs") == []
    assert (tmp_path / "logs" / "synth_manifest.json").is_file()


def test_only_abandoned_folders_of_this_host_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive, host = int(gone.stdout), os.getpid(), socket.gethostname()
    names = {
        f".out.tmp-{host}-{dead}-abc123": False,         # abandoned: removed
        f".out.tmp-{host}-{alive}-abc123": True,         # a live writer's
        f".out.tmp-otherhost-{dead}-abc123": True,       # another host's, on a shared filesystem
        f".out.old-{host}-{dead}-abc123": True,          # without out/, the only copy of the output
        f".outer.tmp-{host}-{dead}-abc123": True,        # another output's
        f".out.tmp-{host}-{dead}-abc123-mine": True,     # not a name genrec makes
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "part.parquet").write_bytes(b"x")
    removed = remove_abandoned(tmp_path / "out")
    assert {p.name for p in removed} == {n for n, kept in names.items() if not kept}
    assert {p.name for p in tmp_path.iterdir()} == {n for n, kept in names.items() if kept}
    (tmp_path / "out").mkdir()  # once the new output is in place, the one moved aside goes
    assert [p.name for p in remove_abandoned(tmp_path / "out")] == [f".out.old-{host}-{dead}-abc123"]


def test_publish_refuses_files_put_into_the_output_while_writing(tmp_path):
    """claim_output_dir checks the folder before the work; a file of the user's put there
    during a long job was deleted by publish_dir, which checked only the manifest."""
    from genrec.data.files import publish_dir, staging_dir

    out = tmp_path / "out"
    _genrec_output(out)
    assert claim_output_dir(out, overwrite=True, manifest=MANIFEST, format="x/1") == out
    tmp = staging_dir(out)
    _genrec_output(tmp)
    (out / "notes.txt").write_text("written while the job ran")
    with pytest.raises(ValueError, match=r"notes\.txt"):
        publish_dir(tmp, out, manifest=MANIFEST, format="x/1")
    assert (out / "notes.txt").read_text() == "written while the job ran"
