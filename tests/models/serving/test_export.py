"""`genrec export` of a tiny trained run whose prepared data has moved: `--data` points at it,
and the default version says the dtype, so the fp32 and int8 artifacts of one checkpoint differ."""

from __future__ import annotations

import pytest
import torch

from genrec.data.prepare import prepare
from genrec.data.synth import synthesize
from genrec.models.build import load_item_corpus
from genrec.models.serving.artifact import load_artifact_contents, read_manifest
from genrec.models.serving.export import export_checkpoint
from genrec.scripts.cli import main
from train_helpers import tiny_config


@pytest.fixture(scope="module")
def moved_run(tmp_path_factory):
    """(run dir, prepared data dir) of a run whose data was moved after training."""
    from genrec.models.train.trainer import run_training

    root = tmp_path_factory.mktemp("exportrun")
    synthesize(root / "logs", num_users=40, num_items=100, num_events=1000, seed=5, progress=False)
    cfg = tiny_config(root / "data", root / "run", max_steps=2, checkpoint_every=2)
    prepare(root / "logs", root / "data", cfg.data.features, cfg.data.prepare.split, num_shards=1,
            row_group_users=16, progress=False)
    run_training(cfg)
    (root / "data").rename(root / "moved")
    return root / "run", root / "moved"


def test_export_without_the_training_data_asks_for_data(moved_run, tmp_path):
    run, _ = moved_run
    with pytest.raises(ValueError, match="--data"):
        export_checkpoint(run, tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_export_reads_data_from_the_flag_and_versions_by_dtype(moved_run, tmp_path):
    run, data = moved_run
    for dtype in ("fp32", "int8"):
        assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / dtype), "--dtype", dtype,
                     "--data", str(data)]) == 0
    fp32, int8 = read_manifest(tmp_path / "fp32"), read_manifest(tmp_path / "int8")
    assert fp32["version"].endswith("-fp32") and int8["version"].endswith("-int8")
    assert fp32["version"].removesuffix("-fp32") == int8["version"].removesuffix("-int8")
    assert fp32["job_config"]["data"]["path"] == str(data.resolve())
    # The item index is the corpus of the data given, not of the path the run trained on.
    assert torch.equal(load_artifact_contents(tmp_path / "fp32").item_ids_N, load_item_corpus(data)[0])


def test_a_delta_takes_its_bases_dtype_unless_told(moved_run, tmp_path, capsys):
    """The quickstart's artifact is int8: `genrec export --delta-since BASE` without --dtype
    writes an int8 delta (an fp32 one would be refused by the base), into a folder whose
    parent is made for it; an approximate index is refused with a delta."""
    import json

    run, data = moved_run
    base = tmp_path / "base"
    assert main(["export", "--checkpoint", str(run), "--out", str(base), "--dtype", "int8", "--data", str(data)]) == 0
    delta = tmp_path / "deltas" / "d1"  # a parent that does not exist yet
    assert main(["export", "--checkpoint", str(run), "--out", str(delta), "--data", str(data),
                 "--delta-since", str(base)]) == 0
    assert json.loads((delta / "manifest.json").read_text())["artifact"]["dtype"] == "int8"
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote delta {delta}"
    assert sorted(p.name for p in delta.parent.iterdir()) == ["d1"]  # the full artifact aside is gone

    # An approximate index is not part of a delta: asking for one is refused, not ignored.
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "d2"), "--data", str(data),
                 "--delta-since", str(base), "--retrieval-index", "ivf"]) == 1
    assert "--retrieval-index ivf and --delta-since do not go together" in capsys.readouterr().err
    assert not (tmp_path / "d2").exists()


def test_a_model_version_with_control_characters_is_refused_before_loading(moved_run, tmp_path, capsys):
    # The version is printed in logs, a Prometheus label and every response: a newline in it
    # split a log line in two.
    run, data = moved_run
    for bad in ("v1\nrelease", "v\x00", "x" * 201):
        assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "a"), "--data", str(data),
                     "--model-version", bad]) == 1
        assert "--model-version" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_export_flags_reach_export_checkpoint(monkeypatch):
    from genrec.models.serving import export as export_module

    seen = {}
    monkeypatch.setattr(export_module, "export_checkpoint", lambda ckpt, out, **kw: seen.update(kw, ckpt=ckpt) or out)
    assert main(["export", "--checkpoint", "run", "--out", "art", "--data", "d", "--model-version", "release-7",
                 "--dtype", "int8"]) == 0
    assert seen == {"ckpt": "run", "dtype": "int8", "version": "release-7", "data_dir": "d", "overwrite": False,
                    "retrieval_index": "auto", "delta_since": None}


def test_a_killed_delta_export_leaves_no_copy_of_the_artifact_for_good(moved_run, tmp_path):
    """A delta is diffed from a full artifact written aside. An export killed before it
    removes that copy (kill -9, an OOM kill) leaves it, the size of the whole artifact: the
    next export to the same output removes it, as it does an abandoned staging folder."""
    import signal
    import subprocess
    import sys

    run, data = moved_run
    base = tmp_path / "base"
    export_checkpoint(run, base, dtype="int8", data_dir=data)
    out = tmp_path / "deltas" / "d1"
    killed = ("import os, signal\n"
              "import genrec.models.serving.export as export\n"
              "export.write_delta = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
              f"export.export_checkpoint({str(run)!r}, {str(out)!r}, data_dir={str(data)!r}, "
              f"delta_since={str(base)!r})\n")
    proc = subprocess.run([sys.executable, "-c", killed], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [p.name for p in out.parent.iterdir() if p.name != "d1"], "the killed export left nothing to remove"
    export_checkpoint(run, out, data_dir=data, delta_since=base)
    assert sorted(p.name for p in out.parent.iterdir()) == ["d1"]
