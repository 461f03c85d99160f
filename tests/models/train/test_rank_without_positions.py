"""A rank whose users give no retrieval position (every history one event long) still
makes the sharded store's collectives of a step: with per-position negatives it draws
none, and must look them up all the same, or the other rank waits on it forever."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.data.batch import Batch
from genrec.models.config import JobConfig
from genrec.models.config_loader import from_dict
from train_helpers import free_port

FEATURES = ["item_id", "action"]


def _config(out: str, negatives: str) -> JobConfig:
    return from_dict(JobConfig, {
        "data": {"path": out, "features": {"sparse": FEATURES, "labels": []},
                 "loader": {"batch_size": 2, "max_seq_len": 8, "mode": "retrieval"}},
        "sparse": {"tables": [{"name": f, "embedding_dim": 8, "feature_names": [f], "learning_rate": 0.05,
                               "device_rows": 64, "host_rows": 64} for f in FEATURES]},
        "dense": {"embedding_dim": 8, "num_layers": 1, "num_heads": 2, "attention_dim": 4, "linear_dim": 4,
                  "max_seq_len": 16, "dropout": 0.0},
        "model": {"retrieval": True, "ranking": False, "negatives": negatives, "num_negatives": 4,
                  "min_target_action": None},
        "train": {"out_dir": out, "precision": "fp32"},
    })


def _batch(lengths: list[int]) -> Batch:
    n = sum(lengths)
    items = torch.arange(1, n + 1, dtype=torch.int64) * 7
    L = torch.tensor(lengths, dtype=torch.int64)
    history = KeyedJaggedTensor(keys=FEATURES, values=torch.cat([items, torch.ones(n, dtype=torch.int64)]),
                                lengths=L.repeat(len(FEATURES)))
    return Batch(user_ids_B=torch.arange(len(lengths)), history=history,
                 timestamps_T=torch.arange(n, dtype=torch.int64) * 10 + 1000, history_lengths_B=L)


def _step(rank: int, world: int, port: int, out: str, negatives: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    try:
        from genrec.models.build import build_model
        from genrec.models.ranks import DistInfo

        model, store = build_model(_config(out, negatives), DistInfo(rank, world, rank, torch.device("cpu")))
        model.set_item_corpus(torch.arange(1, 40, dtype=torch.int64) * 7, torch.ones(39, dtype=torch.int64))
        model.train()
        for _ in range(2):
            loss, _ = model(_batch([3, 3] if rank == 0 else [1, 1]))  # rank 1: no position to predict
            loss.backward()
            store.finish_row_updates()
        dist.barrier()
        with open(os.path.join(out, f"done-{rank}"), "w") as f:
            f.write(repr(float(loss)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("negatives", ["per_position", "shared", "full", "in_batch"])
def test_a_rank_without_positions_keeps_the_collectives_in_step(tmp_path, negatives):
    ctx = mp.start_processes(_step, args=(2, free_port(), str(tmp_path), negatives), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the ranks did not finish their steps")
    assert {"done-0", "done-1"} <= set(os.listdir(tmp_path))
    assert float((tmp_path / "done-1").read_text()) == 0.0
