"""The trainer reads batch t + 1's SSD-tier rows ahead of step t: same training, disk early."""

import json

import torch

from genrec.models.config_loader import to_dict
from train_helpers import tiny_config


def _spy_read_ahead(monkeypatch) -> list[int]:
    from genrec.models.model import GenerativeRecommender

    advised, real = [], GenerativeRecommender.read_ahead
    monkeypatch.setattr(GenerativeRecommender, "read_ahead", lambda self, batch: advised.append(real(self, batch))
                        or advised[-1])
    return advised


def _small_tables(cfg, read_ahead: str):
    """Every table's caches a few rows wide, so the run keeps rows on the SSD tier."""
    for t in cfg.sparse.tables:
        t.device_rows, t.host_rows = 4, 8
    cfg.sparse.read_ahead = read_ahead
    return cfg


def test_reading_ahead_trains_exactly_as_without(prepared, tmp_path, monkeypatch):
    """With rows on the SSD tier, the pipelined trainer advises the next batch's pages before
    every step, and its losses and final rows equal those of a run that never reads ahead."""
    from genrec.models.train.trainer import run_training

    advised = _spy_read_ahead(monkeypatch)
    ahead = run_training(_small_tables(tiny_config(prepared, tmp_path / "ahead", max_steps=8), "on"))
    assert len(advised) == 8 and sum(advised) > 0, "the run never read ahead"
    advised.clear()
    plain = run_training(_small_tables(tiny_config(prepared, tmp_path / "plain", max_steps=8, pipeline=False), "on"))
    assert not advised
    assert ahead == plain


def _run_counting_read_ahead(rank: int, world_size: int, port: int, cfg_json: str, result_path: str) -> None:
    """test_train's _run_training, also saving the SSD rows the trainer's read-ahead advised
    (in the background; a lookup's own advice, on its thread, does not count)."""
    from genrec.sparse.store import TableStore
    from test_train import _run_training

    advised, real = [], TableStore.read_ahead

    def read_ahead(self, ids_N, background=True):
        n = real(self, ids_N, background)
        if background:
            advised.append(n)
        return n

    TableStore.read_ahead = read_ahead
    _run_training(rank, world_size, port, cfg_json, result_path)
    torch.save({**torch.load(f"{result_path}.{rank}"), "advised": sum(advised)}, f"{result_path}.{rank}")


def test_two_ranks_read_ahead_in_step(prepared, tmp_path):
    """With several ranks read-ahead is a collective (ids go to their owners): on, a 2-rank run
    advises SSD rows and finishes with the losses of the same run with it off."""
    from test_train import _spawn

    losses, advised = {}, {}
    for mode in ("on", "off"):
        cfg = _small_tables(tiny_config(prepared, tmp_path / mode, max_steps=4, checkpoint_every=100), mode)
        _spawn(_run_counting_read_ahead, 2, json.dumps(to_dict(cfg)), str(tmp_path / f"losses-{mode}"))
        results = [torch.load(tmp_path / f"losses-{mode}.{r}") for r in range(2)]
        losses[mode] = [r["losses"] for r in results]
        advised[mode] = sum(r["advised"] for r in results)
    assert advised["on"] > 0, "with read_ahead on, the 2-rank run never read ahead"
    assert losses["on"] == losses["off"]
