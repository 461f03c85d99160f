"""2 gloo ranks give the same rows as 1 rank on the same global batch; resharding 1 -> 2 -> 1,
the 2 -> 1 one from an incremental snapshot whose full link's folder is gone."""

from __future__ import annotations

import json
import os
import shutil
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection
from genrec.sparse.hashing import owner_rank

NUM_USERS = 6


def make_config(max_deltas: int = 0) -> SparseConfig:
    return SparseConfig(
        snapshot_max_deltas=max_deltas,
        tables=[
            TableConfig(name="item", embedding_dim=4, feature_names=["item_id", "neg_item"], device_rows=4,
                        host_rows=4, admit_min_count=2, learning_rate=0.05, seed=5),
            TableConfig(name="action", embedding_dim=2, feature_names=["action"], device_rows=2, host_rows=1,
                        learning_rate=0.1, seed=6),
        ],
        ssd_slab_rows=8,
    )


def global_batch(step: int):
    """Per user: history item ids, actions, and 2 negatives."""
    g = torch.Generator().manual_seed(step)
    users = []
    for _ in range(NUM_USERS):
        n = int(torch.randint(1, 5, (1,), generator=g))
        users.append((torch.randint(0, 60, (n,), generator=g).tolist(), torch.randint(0, 3, (n,), generator=g).tolist(),
                      torch.randint(0, 60, (2,), generator=g).tolist()))
    return users


def kjts(users):
    hist = KeyedJaggedTensor.from_lengths_sync(
        keys=["item_id", "action"],
        values=torch.tensor([x for u in users for x in u[0]] + [x for u in users for x in u[1]], dtype=torch.int64),
        lengths=torch.tensor([len(u[0]) for u in users] * 2, dtype=torch.int64),
    )
    neg = KeyedJaggedTensor.from_lengths_sync(
        keys=["neg_item"], values=torch.tensor([x for u in users for x in u[2]], dtype=torch.int64),
        lengths=torch.full((len(users),), 2, dtype=torch.int64),
    )
    return hist, neg


def train(tec, users_of_step, steps: int, start: int = 0) -> None:
    for step in range(start, steps):
        hist, neg = kjts(users_of_step(step))
        if step % 2:
            tec.prefetch(hist)  # a collective too; must not change any value
        out, out_neg = tec(hist), tec(neg)
        # A sum of per-occurrence terms: the global loss is the sum of the ranks' losses.
        loss = (out["item_id"].values().sum() + out["item_id"].values().square().sum()
                + 2 * out["action"].values().sum() - out_neg["neg_item"].values().square().sum())
        loss.backward()


def rows_by_id(tec):
    out = {}
    for name, store in tec.stores.items():
        ids, rows, _ = store.all_rows()
        order = torch.argsort(ids)
        out[name] = (ids[order], rows[order])
    return out


def opened_during(fn) -> list[str]:
    """Base names of the files the snapshot module opened while fn ran."""
    from genrec.sparse import snapshot

    seen = []

    def recording_open(path, *args, **kwargs):
        seen.append(os.path.basename(str(path)))
        return open(path, *args, **kwargs)

    snapshot.open = recording_open  # shadows the builtin inside that module only
    try:
        fn()
    finally:
        del snapshot.open
    return seen


def _worker(rank: int, world: int, port: int, out_dir: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # Reshard 1 -> 2: the snapshot the single-rank run saved, loaded under 2 ranks.
    from_single = TieredEmbeddingCollection(make_config())
    from_single.load_snapshot(os.path.join(out_dir, "single_snap"))
    tec = TieredEmbeddingCollection(make_config(max_deltas=2))
    train(tec, lambda s: global_batch(s)[rank::world], steps // 2)
    tec.save_snapshot(os.path.join(out_dir, "base_snap"))  # full; "snap" below is a delta on it
    train(tec, lambda s: global_batch(s)[rank::world], steps, start=steps // 2)
    for name, (ids, rows) in rows_by_id(from_single).items():
        mine = rows_by_id(tec)[name]
        assert torch.equal(ids, mine[0]), f"rank {rank} {name}: resharded ids differ"
        torch.testing.assert_close(rows, mine[1], atol=1e-6, rtol=1e-6)
    # eval under 2 ranks: read-only and consistent with the owner's rows
    tec.eval()
    hist, _ = kjts(global_batch(0)[rank::world])
    probe = tec(hist)["item_id"].values()
    tec.train()
    tec.save_snapshot(os.path.join(out_dir, "snap"))
    dist.barrier()
    if rank == 0:  # the full link's own folder goes (a pruned checkpoint): "snap" holds its chain
        shutil.rmtree(os.path.join(out_dir, "base_snap"))
    # Same world size: each rank reads its own shard only, not world-size times the I/O.
    reloaded = TieredEmbeddingCollection(make_config())
    opened = opened_during(lambda: reloaded.load_snapshot(os.path.join(out_dir, "snap")))
    shard_files = [f for f in opened if f.endswith(".bin")]
    assert shard_files and all(f".rank{rank}." in f for f in shard_files), f"rank {rank} read {shard_files}"
    for name, (ids, rows) in rows_by_id(tec).items():
        assert torch.equal(ids, rows_by_id(reloaded)[name][0]) and torch.equal(rows, rows_by_id(reloaded)[name][1])
    torch.save({"rows": rows_by_id(tec), "probe": probe}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_equal_one_rank_and_snapshots_reshard(tmp_path):
    steps = 8
    single = TieredEmbeddingCollection(make_config())
    train(single, global_batch, steps)
    expected = rows_by_id(single)
    single.save_snapshot(str(tmp_path / "single_snap"))
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), steps), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, (ids, rows) in expected.items():
        got_ids = torch.cat([p["rows"][name][0] for p in parts])
        got_rows = torch.cat([p["rows"][name][1] for p in parts])
        order = torch.argsort(got_ids)
        assert torch.equal(got_ids[order], ids), name
        torch.testing.assert_close(got_rows[order], rows, atol=1e-6, rtol=1e-6)
        for r, p in enumerate(parts):  # every rank holds only the rows it owns
            assert (owner_rank(p["rows"][name][0], 2) == r).all()
    single.eval()
    for r, p in enumerate(parts):
        hist, _ = kjts(global_batch(0)[r::2])
        torch.testing.assert_close(p["probe"], single(hist)["item_id"].values(), atol=1e-6, rtol=1e-6)
    assert json.loads((tmp_path / "snap" / "MANIFEST.json").read_text())["kind"] == "delta"
    resharded = TieredEmbeddingCollection(make_config())
    opened = opened_during(lambda: resharded.load_snapshot(str(tmp_path / "snap")))
    assert all(any(f".rank{r}." in f for f in opened) for r in range(2)), "2 -> 1 must read both shards"
    for name, (ids, rows) in rows_by_id(resharded).items():
        assert torch.equal(ids, expected[name][0])
        torch.testing.assert_close(rows, expected[name][1], atol=1e-6, rtol=1e-6)
