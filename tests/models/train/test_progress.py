import json
import sys
import time
from pathlib import Path

import pytest
import torch

from genrec.models.train.progress import ProgressLogger, RateMeter


def test_jsonl_and_tensorboard_hold_the_logged_metrics(tmp_path: Path, capsys) -> None:
    with ProgressLogger(tmp_path, total_steps=30, rank=0) as progress:
        for step in (10, 20, 30):
            progress.log(step, {"loss": 1.0 / step, "samples_per_s": 100.0 * step,
                                "cache/hit_rate": torch.tensor(0.5)})
            # Flushed per line: a reader sees the line before close.
            lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
            assert json.loads(lines[-1])["step"] == step
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    assert records[1]["loss"] == pytest.approx(0.05) and records[2]["cache/hit_rate"] == 0.5
    assert "loss=0.03333" in capsys.readouterr().err  # the bar's postfix, on stderr

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "samples_per_s", "cache/hit_rate"}
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [10, 20, 30]
    assert [e.value for e in loss] == pytest.approx([0.1, 0.05, 1 / 30])


def test_resume_appends_and_other_ranks_write_nothing(tmp_path: Path) -> None:
    with ProgressLogger(tmp_path, total_steps=4, rank=0, enable_tensorboard=False) as p:
        p.log(1, {"loss": 2.0})
    with ProgressLogger(tmp_path, total_steps=4, rank=0, enable_tensorboard=False, start_step=1) as p:
        p.log(2, {"loss": 1.0})
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (tmp_path / "tensorboard").exists()

    other = tmp_path / "rank1"
    with ProgressLogger(other, total_steps=4, rank=1) as p:
        p.log(1, {"loss": 2.0})
    assert not other.exists()


def test_non_scalar_metric_is_named(tmp_path: Path) -> None:
    with ProgressLogger(tmp_path, total_steps=4, rank=0, enable_tensorboard=False) as p:
        with pytest.raises(ValueError, match="'auc'.*shape"):
            p.log(1, {"loss": 1.0, "auc": torch.zeros(2)})
        with pytest.raises(ValueError, match="'name' must be a number"):
            p.log(1, {"name": "x"})


def test_missing_tensorboard_is_a_clear_error_only_when_enabled(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    with pytest.raises(ImportError, match="pip install tensorboard"):
        ProgressLogger(tmp_path, total_steps=4, rank=0)
    ProgressLogger(tmp_path, total_steps=4, rank=0, enable_tensorboard=False).close()


def test_rate_meter() -> None:
    rate = RateMeter()
    rate.add(samples=100)
    time.sleep(0.05)
    r = rate.tick(samples=100, tokens=1000)
    assert set(r) == {"samples_per_s", "tokens_per_s"}
    assert r["tokens_per_s"] == pytest.approx(5 * r["samples_per_s"])  # counts summed since last tick
    assert 0 < r["samples_per_s"] < 200 / 0.05
    assert rate.tick() == {}


def test_a_record_cut_short_is_dropped_not_joined_to_the_next(tmp_path: Path) -> None:
    """A run killed (or out of disk) mid-write leaves a last line without its newline; the
    resumed run's first record must start a line of its own, every line parsing."""
    complete = json.dumps({"step": 1, "loss": 2.0}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(complete + '{"step": 2, "lo')
    with ProgressLogger(tmp_path, total_steps=4, rank=0, enable_tensorboard=False, start_step=1) as p:
        p.log(2, {"loss": 1.5})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 2.0), (2, 1.5)]
