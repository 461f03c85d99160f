"""A run directory with damaged checkpoints or config: a step dir without a valid COMPLETE
marker is skipped with a warning naming it, never silently, and never started over on top
of; a resume without the run's config.json is refused; a refused start writes nothing; and
eval / export name a checkpoint that does not fit the run's config instead of failing
inside torch."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from genrec.models.runs import CorruptCheckpoint, load_trained, resolve_checkpoint
from train_helpers import tiny_config


@pytest.fixture(scope="module")
def finished(prepared, tmp_path_factory) -> Path:
    """A finished 4-step run: checkpoints step-2 and step-4, best.json on step 4 (tests copy it)."""
    from genrec.models.train.trainer import run_training

    run = tmp_path_factory.mktemp("finished") / "run"
    run_training(tiny_config(prepared, run, max_steps=4, checkpoint_every=2))
    assert json.loads((run / "best.json").read_text())["step"] == 4
    return run


def _copy(finished: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


def _files(run: Path) -> dict[Path, bytes]:
    return {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def _edited(edit):
    def apply(marker: Path) -> None:
        fields = json.loads(marker.read_text())
        edit(fields)
        marker.write_text(json.dumps(fields))
    return apply


DAMAGE = {
    "truncated": lambda marker: marker.write_bytes(marker.read_bytes()[:50]),
    "removed": lambda marker: marker.unlink(),
    "no bytes": _edited(lambda m: m["files"]["dense.pt"].pop("bytes")),
    "no files": _edited(lambda m: m.pop("files")),
    "no fingerprint": _edited(lambda m: m.pop("config_fingerprint")),
    "no dense.pt": _edited(lambda m: m["files"].pop("dense.pt")),
    "world_size two": _edited(lambda m: m.update(world_size="two")),
}
"""Ways a COMPLETE marker goes bad, each applied to the marker's path."""


@pytest.mark.parametrize("how", ["truncated", "removed", "no files"])
def test_a_run_whose_only_checkpoint_has_no_valid_marker_is_refused_untouched(prepared, finished, tmp_path, how):
    from genrec.models.train.trainer import run_training

    run = _copy(finished, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step-00000002")
    DAMAGE[how](run / "checkpoints" / "step-00000004" / "COMPLETE")
    before = _files(run)
    # A new seed, which a resume refuses: starting over from step 0 would have taken it.
    with pytest.raises(ValueError, match="--fresh") as err:
        run_training(tiny_config(prepared, run, max_steps=4, checkpoint_every=2, seed=7))
    assert "step-00000004" in str(err.value) and "no complete checkpoint" in str(err.value)
    assert _files(run) == before


def test_fresh_starts_over_where_no_checkpoint_is_complete(prepared, finished, tmp_path):
    from genrec.models.runs import complete_steps
    from genrec.models.train.trainer import run_training

    run = _copy(finished, tmp_path)
    for step_dir in (run / "checkpoints").iterdir():
        (step_dir / "COMPLETE").unlink()
    assert len(run_training(tiny_config(prepared, run, max_steps=2, checkpoint_every=2), fresh=True)) == 2
    assert [s for s, _ in complete_steps(run / "checkpoints")] == [2]


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_step_without_a_valid_marker_is_skipped_with_a_warning_naming_it(prepared, finished, tmp_path, capsys,
                                                                            how):
    from genrec.models.train.distributed import init_distributed
    from genrec.models.train.trainer import Trainer

    run = _copy(finished, tmp_path)
    newest = run / "checkpoints" / "step-00000004"
    DAMAGE[how](newest / "COMPLETE")
    capsys.readouterr()
    trainer = Trainer(tiny_config(prepared, run, max_steps=4, checkpoint_every=2), init_distributed())
    assert trainer.step == 2
    out, err = capsys.readouterr()
    warning = next((line for line in err.splitlines() if f"skipping checkpoint {newest}" in line), None)
    assert warning is not None and "COMPLETE" in warning, err
    assert f"resumed from {run / 'checkpoints' / 'step-00000002'}" in out


@pytest.mark.parametrize("how", ["removed", "truncated"])
def test_a_resume_without_a_readable_config_json_is_refused_naming_it(prepared, finished, tmp_path, how):
    from genrec.models.train.trainer import run_training

    run = _copy(finished, tmp_path)
    DAMAGE[how](run / "config.json")
    before = _files(run)
    with pytest.raises(ValueError, match="config.json") as err:
        run_training(tiny_config(prepared, run, max_steps=6, checkpoint_every=2, seed=5))
    assert "--fresh" in str(err.value)
    assert _files(run) == before


def test_a_refused_start_writes_nothing(prepared, finished, tmp_path):
    from genrec.models.train.trainer import run_training

    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        run_training(tiny_config(prepared, tmp_path / "typo"), resume=True)
    assert not (tmp_path / "typo").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        run_training(tiny_config(prepared, tmp_path / "empty"), resume=True)
    assert not any((tmp_path / "empty").iterdir())  # not marked as a run that --fresh may clear
    with pytest.raises(ValueError, match="nodata"):
        run_training(tiny_config(tmp_path / "nodata", tmp_path / "new"))
    assert not (tmp_path / "new").exists()
    bad_model = tiny_config(prepared, tmp_path / "new")
    bad_model.model.ranking_tasks = ["click", "dwell"]  # passes the config's checks, refused by the model
    with pytest.raises(ValueError, match="dwell"):
        run_training(bad_model)
    assert not (tmp_path / "new").exists()  # was left holding run.json
    on_cpu = tiny_config(prepared, tmp_path / "new")
    on_cpu.dense.kernel = "triton"  # CUDA only (the interpreter is for tests): a traceback after run.json
    with pytest.MonkeyPatch.context() as mp, pytest.raises(ValueError, match='dense.kernel = "triton"'):
        mp.delenv("TRITON_INTERPRET", raising=False)
        run_training(on_cpu)
    assert not (tmp_path / "new").exists()
    if not torch.cuda.is_available():
        no_gpu = tiny_config(prepared, tmp_path / "new")
        no_gpu.sparse.device = "cuda"  # was torch's AssertionError, naming no key
        with pytest.raises(ValueError, match="sparse.device = 'cuda'"):
            run_training(no_gpu)
        assert not (tmp_path / "new").exists()
    run = _copy(finished, tmp_path)
    before = _files(run)
    with pytest.raises(ValueError, match="nodata"):
        run_training(tiny_config(tmp_path / "nodata", run), fresh=True)  # the old run is not cleared first
    assert _files(run) == before


def test_a_fresh_start_the_model_refuses_keeps_the_old_run(prepared, finished, tmp_path):
    """`--fresh` with a config that passes the loader's checks but that building the model
    refuses (here a ranking task the data has no label for): the old run's checkpoints and
    best.json must stay, as for a wrong data.path (it cleared them, then refused)."""
    from genrec.models.train.trainer import run_training

    run = _copy(finished, tmp_path)
    before = _files(run)
    bad_model = tiny_config(prepared, run)
    bad_model.model.ranking_tasks = ["click", "dwell"]
    with pytest.raises(ValueError, match="dwell"):
        run_training(bad_model, fresh=True)
    assert _files(run) == before
    assert len(run_training(tiny_config(prepared, run, max_steps=2, checkpoint_every=2), fresh=True)) == 2


def test_eval_names_a_checkpoint_that_does_not_fit_the_run_config(finished, tmp_path):
    run = _copy(finished, tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["dense"]["linear_dim"] *= 2  # as if the step dirs came from another run
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not match the current config: dense\.linear_dim: checkpoint '8', "
                                         r"now '16'"):
        load_trained(run)


def test_eval_skips_damaged_steps_and_says_which_it_used(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    newest = run / "checkpoints" / "step-00000004"
    DAMAGE["no dense.pt"](newest / "COMPLETE")
    with pytest.raises(CorruptCheckpoint, match=r"COMPLETE lists no dense\.pt"):
        load_trained(newest)
    capsys.readouterr()
    assert resolve_checkpoint(run) == (run / "checkpoints" / "step-00000002", run)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {newest}: {newest / 'COMPLETE'} lists no dense.pt" in err
    assert f"{run / 'best.json'} names step-00000004, which is not a complete checkpoint; using the latest, " \
           "step-00000002" in err

    shutil.rmtree(newest)  # best.json names a step that is gone
    assert resolve_checkpoint(run)[0].name == "step-00000002"
    err = capsys.readouterr().err
    assert "best.json names step-00000004" in err and "skipping" not in err

    shutil.rmtree(run / "checkpoints" / "step-00000002")
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint") as e:
        resolve_checkpoint(run)
    assert "resume" not in str(e.value)


def test_a_fresh_start_killed_while_removing_the_old_run_can_be_started_again(prepared, finished, tmp_path):
    """kill -9 while --fresh deletes the old run (gigabytes of checkpoints take a while): the
    folder must still be a run that the next --fresh (or plain start) accepts and tidies,
    not a foreign folder that both refuse."""
    import os
    import signal
    import subprocess
    import sys

    from genrec.models.train.trainer import run_training

    run = _copy(finished, tmp_path)
    killed = ("import os, shutil, signal, sys\n"
              "from pathlib import Path\n"
              "from genrec.models.train.resume import start_fresh\n"
              "shutil.rmtree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # killed mid-removal\n"
              "start_fresh(Path(sys.argv[1]))\n")
    proc = subprocess.run([sys.executable, "-c", killed, str(run)], stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert len(run_training(tiny_config(prepared, run, max_steps=2, checkpoint_every=2), fresh=True)) == 2
    assert not [p for p in run.iterdir() if p.name.startswith(".fresh-removed-")]
