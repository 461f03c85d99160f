"""`genrec profile train|sparse|serve`: the three outputs, every stage timed, and the overwrite rule."""

from __future__ import annotations

import json

import pytest

from genrec.data.files import OutputExistsError
from genrec.models.train.profile import (SERVE_STAGES, SPARSE_STAGES, TRAIN_STAGES, profile_serving, profile_sparse,
                                         profile_training)
from train_helpers import tiny_config


def test_profile_writes_trace_tensorboard_and_summary_with_every_stage(prepared, tmp_path):
    out = tmp_path / "profile"
    summary = profile_training(tiny_config(prepared, tmp_path / "unused"), steps=2, out=out)
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    # Every stage the trainer opens a range for shows up in the Chrome trace.
    assert set(TRAIN_STAGES[:-1]) <= names, set(TRAIN_STAGES[:-1]) - names
    assert any(p.name.endswith(".pt.trace.json") for p in (out / "tensorboard").iterdir())
    timed = {s["stage"]: s["ms_per_step"] for s in summary["stages"]}
    assert all(timed[s] > 0 for s in ("genrec.sparse_forward", "genrec.tower", "genrec.loss", "genrec.backward"))
    assert sum(v for k, v in timed.items() if "inside" not in k) == pytest.approx(summary["step_ms"], rel=0.05)
    assert 0 < summary["mfu"] < 1 and summary["top_operators"]
    md = (out / "summary.md").read_text()
    assert "| genrec.tower |" in md and "MFU" in md
    assert (out / "run" / "checkpoints").is_dir()  # the profiled run's checkpoint


def test_profile_refuses_a_foreign_directory_and_replaces_its_own(prepared, tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    with pytest.raises(OutputExistsError):
        profile_training(tiny_config(prepared, tmp_path / "unused"), steps=1, out=foreign, overwrite=True)
    assert (foreign / "mine.txt").read_text() == "keep me"
    out = tmp_path / "profile"
    profile_training(tiny_config(prepared, tmp_path / "unused"), steps=1, out=out)
    profile_training(tiny_config(prepared, tmp_path / "unused"), steps=1, out=out, overwrite=True)
    assert json.loads((out / "summary.json").read_text())["steps"] == 1


def test_a_refused_profile_keeps_the_earlier_one_and_writes_nothing(prepared, tmp_path):
    """A wrong --artifact / --data / data.path is found only once the profile starts: the
    earlier profile that --overwrite would replace must still be there, and a new --out is
    not left behind empty (it was removed first, then the profile refused)."""
    out = tmp_path / "profile"
    profile_training(tiny_config(prepared, tmp_path / "unused"), steps=1, out=out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(FileNotFoundError, match="no artifact manifest"):
        profile_serving(tmp_path / "no-artifact", prepared, steps=1, out=out, overwrite=True)
    with pytest.raises(ValueError, match="nodata"):
        profile_training(tiny_config(tmp_path / "nodata", tmp_path / "unused"), steps=1, out=out, overwrite=True)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile"]
    with pytest.raises(FileNotFoundError, match="no artifact manifest"):
        profile_serving(tmp_path / "no-artifact", prepared, steps=1, out=tmp_path / "new")
    assert not (tmp_path / "new").exists()
    profile_training(tiny_config(prepared, tmp_path / "unused"), steps=1, out=out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile"]


def _stages_timed(out, summary, stages):
    names = {e.get("name") for e in json.loads((out / "trace.json").read_text())["traceEvents"]}
    assert set(stages) <= names, set(stages) - names
    timed = {s["stage"]: s["ms_per_step"] for s in summary["stages"]}
    assert sum(timed.values()) == pytest.approx(summary["step_ms"], rel=0.05)
    assert (out / "summary.md").is_file() and any((out / "tensorboard").iterdir())
    return timed


def test_profile_sparse_times_the_store_alone_and_updates_rows(prepared, tmp_path):
    out = tmp_path / "sparse"
    summary = profile_sparse(tiny_config(prepared, tmp_path / "unused"), steps=2, out=out)
    timed = _stages_timed(out, summary, SPARSE_STAGES)
    assert timed["genrec.sparse_forward"] > 0 and timed["genrec.sparse_backward"] > 0
    assert summary["target"] == "sparse" and summary["lookups_per_s"] > 0
    assert "lookups (and their updates) per second" in (out / "summary.md").read_text()


def test_profile_serve_times_each_step_of_a_ranking_request(prepared, tmp_path):
    from genrec.models.serving.export import export_checkpoint

    cfg = tiny_config(prepared, tmp_path / "unused")
    profile_training(cfg, steps=1, out=tmp_path / "train")
    artifact = export_checkpoint(tmp_path / "train" / "run", tmp_path / "artifact")
    out = tmp_path / "serve"
    summary = profile_serving(artifact, prepared, steps=3, out=out, k=20)
    stages = SERVE_STAGES if cfg.model.ranking else tuple(s for s in SERVE_STAGES if s != "genrec.serve.rank")
    timed = _stages_timed(out, summary, stages)
    assert timed["genrec.serve.encode"] > 0 and timed["genrec.serve.retrieve"] > 0
    assert (out / "summary.md").read_text().startswith("# Serving profile: 3 requests")
