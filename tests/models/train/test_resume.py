"""Training again into a run directory: changed settings are applied after the restore (the
learning rate from the new config, not the checkpoint's optimizer state) or refused naming
the keys, config.json records only what is in effect, and `--fresh` starts over in a genrec
training run only, removing nothing else."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from genrec.models.config_loader import to_dict
from genrec.models.train.schedule import warmup_cosine
from genrec.scripts.cli import main
from train_helpers import tiny_config


def _records(run: Path) -> dict[int, dict]:
    """The last metrics.jsonl record with a loss per step (a resumed run appends)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec
    return out


NEW = dict(max_steps=10, log_every=2, eval_every=2, optim={"lr": 0.004, "warmup_steps": 2})
"""The settings of the resumed run (the first part ran with the defaults of tiny_config)."""


def test_changed_settings_take_effect_after_the_restore(prepared, tmp_path, capsys):
    from genrec.models.train.distributed import init_distributed
    from genrec.models.train.trainer import Trainer, run_training

    reference = tmp_path / "ref"
    run_training(tiny_config(prepared, reference, checkpoint_every=4, **NEW))
    ref = _records(reference)

    run = tmp_path / "run"
    run_training(tiny_config(prepared, run, checkpoint_every=4, optim={"lr": 0.001}))  # steps 1-6
    capsys.readouterr()
    trainer = Trainer(tiny_config(prepared, run, checkpoint_every=4, **NEW), init_distributed())
    err = capsys.readouterr().err
    for change in ("train.optim.lr: 0.001 -> 0.004", "train.max_steps: 6 -> 10", "train.log_every: 1 -> 2",
                   "train.eval_every: 0 -> 2", "train.optim.warmup_steps: 0 -> 2"):
        assert change in err, err
    # The next step's lr is the new schedule's for step 7, whatever the optimizer state saved.
    assert trainer.step == 6
    o = trainer.cfg.train.optim
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=o.lr)
    step7 = o.lr * warmup_cosine(dummy, warmup_steps=o.warmup_steps, total_steps=10,
                                 min_lr_ratio=o.min_lr_ratio).lr_lambdas[0](6)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([step7] * 2, rel=1e-12)
    trainer.train()
    got = _records(run)
    assert [s for s in got if s > 6] == [8, 10]  # the new log cadence
    for step in (8, 10):
        assert got[step]["lr"] == pytest.approx(ref[step]["lr"], rel=1e-12), step
    validated = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
                 if "valid/ndcg@10" in line]
    assert validated == [6, 8, 10]  # the end of the first part, then every 2 steps
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["optim"]["lr"], saved["max_steps"], saved["eval_every"]) == (0.004, 10, 2)


@pytest.fixture(scope="module")
def short_run(prepared, tmp_path_factory) -> Path:
    """A finished 3-step run (tests copy it before training into it again)."""
    from genrec.models.train.trainer import run_training

    run = tmp_path_factory.mktemp("short") / "run"
    run_training(tiny_config(prepared, run, max_steps=3))
    return run


@pytest.mark.parametrize("key,value", [
    ("dense.num_layers", 2), ("dense.max_seq_len", 48), ("dense.kind", "transformer"),
    ("model.ranking_tasks", ["click"]), ("data.loader.batch_size", 4), ("data.loader.max_seq_len", 16),
    ("sparse.tables[item_id].embedding_dim", 8), ("train.seed", 1), ("dense.normalizer", "num_keys"),
])
def test_changes_a_resume_cannot_apply_are_refused_naming_the_key(prepared, short_run, tmp_path, key, value):
    from genrec.models.config import JobConfig
    from genrec.models.config_loader import from_dict
    from genrec.models.train.trainer import run_training

    run = tmp_path / "run"
    shutil.copytree(short_run, run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    raw = to_dict(tiny_config(prepared, run, max_steps=6))  # a longer run may resume: only `key` is refused
    if key.startswith("sparse.tables"):
        raw["sparse"]["tables"][0]["embedding_dim"] = value
    else:
        *path, last = key.split(".")
        node = raw
        for part in path:
            node = node[part]
        node[last] = value
    with pytest.raises(ValueError, match=r"--fresh") as err:
        run_training(from_dict(JobConfig, raw))
    assert key in str(err.value) and "train.max_steps" not in str(err.value)  # max_steps may change
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before  # nothing written: no checkpoint, config.json as it was


def _toml(tree: dict, prefix: str = "") -> str:
    """A config dict as a TOML run file (scalars and lists as JSON, which TOML reads alike)."""
    lines, later = [], []
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            later.append(f"[{name}]\n" + _toml(value, name))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            later += [f"[[{name}]]\n" + _toml(v, name) for v in value]
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines + [""] + later)


def test_fresh_starts_over_only_in_a_genrec_run_and_keeps_other_files(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    config = tmp_path / "tiny.toml"
    config.write_text(_toml(to_dict(tiny_config(prepared, run, max_steps=3))))
    train = ["train", "--config", str(config)]
    assert main(train) == 0
    (run / "notes.txt").write_text("mine")
    (run / "report").mkdir()
    (run / "report" / "report.json").write_text("{}")

    assert main(train + ["--set", "dense.num_layers=2"]) == 1
    err = capsys.readouterr().err
    assert "dense.num_layers: 1 -> 2" in err and "--fresh" in err and "Traceback" not in err

    assert main(train + ["--set", "dense.num_layers=2", "--fresh"]) == 0
    assert json.loads((run / "config.json").read_text())["dense"]["num_layers"] == 2
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3]  # a new run, not appended to the old
    assert (run / "notes.txt").read_text() == "mine" and (run / "report" / "report.json").exists()
    assert not [p for p in run.iterdir() if p.name.startswith(".")]

    other = tmp_path / "not-a-run"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "checkpoints").mkdir()
    (other / "checkpoints" / "mine.bin").write_bytes(b"mine")
    config.write_text(_toml(to_dict(tiny_config(prepared, other, max_steps=3))))
    # Neither a plain run (which would write its config.json over the folder's and mark the
    # folder as a run, for a later --fresh to clear) nor --fresh touches a foreign folder.
    assert main(train) == 1
    assert "not a genrec training run" in capsys.readouterr().err
    assert main(train + ["--fresh"]) == 1
    assert "not a genrec output" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["checkpoints", "config.json"]
    assert (other / "config.json").read_text() == "{}" and (other / "checkpoints" / "mine.bin").exists()
    with pytest.raises(SystemExit):
        main(train + ["--fresh", "--resume"])
