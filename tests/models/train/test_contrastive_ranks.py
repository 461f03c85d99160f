"""With "full" negatives the corpus is looked up alike on every rank, so its ids count as one
sighting per step, as on one rank, not one per rank: also under `model.contrastive_weight`
(its two-view forward). Admission (admit_min_count 2) then materializes the same rows on 2
ranks as on 1 on the same global batch."""

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
USERS, LENGTH = 4, 3


def _config(out: str, contrastive: float) -> JobConfig:
    return from_dict(JobConfig, {
        "data": {"path": out, "features": {"sparse": FEATURES, "labels": []},
                 "loader": {"batch_size": 2, "max_seq_len": 8, "mode": "retrieval"}},
        "sparse": {"tables": [{"name": f, "embedding_dim": 8, "feature_names": [f], "learning_rate": 0.05,
                               "device_rows": 64, "host_rows": 64, "admit_min_count": 2} for f in FEATURES]},
        "dense": {"embedding_dim": 8, "num_layers": 1, "num_heads": 2, "attention_dim": 4, "linear_dim": 4,
                  "max_seq_len": 16, "dropout": 0.0},
        "model": {"retrieval": True, "ranking": False, "negatives": "full", "contrastive_weight": contrastive,
                  "min_target_action": None},
        "train": {"out_dir": out, "precision": "fp32"},
    })


def _users(lo: int, hi: int) -> Batch:
    """Users lo..hi-1 of the global batch: each LENGTH distinct items (ids 7, 14, ...)."""
    items = torch.arange(lo * LENGTH + 1, hi * LENGTH + 1, dtype=torch.int64) * 7
    n, L = items.numel(), torch.full((hi - lo,), LENGTH, dtype=torch.int64)
    history = KeyedJaggedTensor(keys=FEATURES, values=torch.cat([items, torch.ones(n, dtype=torch.int64)]),
                                lengths=L.repeat(len(FEATURES)))
    return Batch(user_ids_B=torch.arange(lo, hi), history=history,
                 timestamps_T=torch.arange(n, dtype=torch.int64) * 10 + 1000, history_lengths_B=L)


def _item_rows(rank: int, world: int, port: int, out: str, contrastive: float) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
    from genrec.models.build import build_model
    from genrec.models.ranks import DistInfo

    model, store = build_model(_config(out, contrastive), DistInfo(rank, world, rank, torch.device("cpu")))
    model.set_item_corpus(torch.arange(1, 40, dtype=torch.int64) * 7, torch.ones(39, dtype=torch.int64))
    model.train()
    share = USERS // world
    loss, _ = model(_users(rank * share, (rank + 1) * share))
    loss.backward()
    store.finish_row_updates()
    ids, _, _ = store.stores["item_id"].all_rows()
    torch.save(ids, f"{out}/rows-{world}-{rank}.pt")
    if world > 1:
        dist.destroy_process_group()


@pytest.mark.parametrize("contrastive", [0.0, 0.5])
def test_full_corpus_counts_once_on_two_ranks_as_on_one(tmp_path, contrastive):
    rows = {}
    for world in (1, 2):
        mp.start_processes(_item_rows, args=(world, free_port(), str(tmp_path), contrastive), nprocs=world,
                           join=True, start_method="spawn")
        rows[world] = torch.sort(torch.cat([torch.load(tmp_path / f"rows-{world}-{r}.pt")
                                            for r in range(world)])).values
    # Only the history items are seen twice (in a history and in the corpus).
    assert rows[1].tolist() == [7 * i for i in range(1, USERS * LENGTH + 1)]
    assert rows[2].tolist() == rows[1].tolist()
