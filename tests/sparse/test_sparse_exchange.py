"""The grouped exchange's first all-to-all carries its split counts in a block of a shared
capacity: 3 gloo ranks whose id counts grow, shrink, overflow on one rank only and drop
to zero must receive exactly what the exchange with counts sent ahead delivers, make the
same number of all-to-alls on every rank, and agree on the capacity. Row updates deferred
past backward give the same rows, bit for bit, as updates applied in it."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genrec.sparse import TieredEmbeddingCollection
from genrec.sparse.module import _Capacity, _Exchange
from test_sparse_dist import _free_port, global_batch, kjts, make_config, rows_by_id

WORLD = 3
# Ids per rank at each step: the same sizes (capacity learnt, then used), rank 2 alone far
# larger (its overflow must send every rank down the second path), smaller again, much
# smaller (the capacity shrinks), a rank with no ids at all, and larger again.
SIZES = [(40, 50, 45), (42, 48, 44), (40, 50, 400), (30, 35, 30), (3, 2, 4), (0, 20, 10), (41, 47, 45)]


def _ids(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randperm(1 << 20, generator=g)[: SIZES[step][rank]].to(torch.int64)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    real, calls = dist.all_to_all_single, []

    def counted(*args, **kwargs):
        calls[-1] += 1
        return real(*args, **kwargs)

    dist.all_to_all_single = counted
    capacity, record = _Capacity(), []
    for step in range(len(SIZES)):
        ids = _ids(rank, step)
        payload = torch.stack([ids, ids * 3 + 1, torch.full_like(ids, rank)], dim=1)
        calls.append(0)
        got = _Exchange(ids, dist.group.WORLD, payload, capacity)
        calls.append(0)
        want = _Exchange(ids, dist.group.WORLD)  # the counts first, then the payload
        record.append({"got": got.payload_R, "want": want.to_owner(payload), "recv": got.recv_list,
                       "want_recv": want.recv_list, "send": want.send_list, "capacity": capacity.rows})
    dist.all_to_all_single = real
    torch.save({"record": record, "calls": calls[0::2]}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_counts_travel_with_the_payload_and_every_rank_agrees(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for r, out in enumerate(ranks):
        for step, rec in enumerate(out["record"]):
            assert torch.equal(rec["got"], rec["want"]), f"rank {r} step {step}"
            assert rec["recv"] == rec["want_recv"]
            # every id it received is its own, and from the rank the last column names
            assert rec["got"][:, 2].tolist() == [j for j, n in enumerate(rec["recv"]) for _ in range(n)]
    calls = ranks[0]["calls"]
    assert all(out["calls"] == calls for out in ranks), [out["calls"] for out in ranks]
    capacities = [rec["capacity"] for rec in ranks[0]["record"]]
    assert all([rec["capacity"] for rec in out["record"]] == capacities for out in ranks)
    before = 0
    for step in range(len(SIZES)):
        need = max(max(out["record"][step]["send"]) for out in ranks)  # the largest count any rank sent
        # One all-to-all when every rank's counts fit the capacity, two when any rank's do not.
        assert calls[step] == (1 if need <= before else 2), (step, need, before, calls)
        assert capacities[step] >= need  # the same sizes fit next time
        before = capacities[step]
    assert calls[0] == 2 and calls[1] == 1 and calls[2] == 2, calls  # learn; fit; rank 2 alone overflows
    assert capacities[4] < capacities[3], capacities  # shrinks after a much smaller step


def _deferring_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    now, later = TieredEmbeddingCollection(make_config()), TieredEmbeddingCollection(make_config())
    later.defer_row_updates = True
    for step in range(6):
        for tec in (now, later):
            hist, neg = kjts(global_batch(step)[rank::WORLD])
            out, out_neg = tec.lookup_many([hist, neg]) if step % 2 else (tec(hist), tec(neg))
            before = rows_by_id(tec)
            (out["item_id"].values().square().sum() + out["action"].values().sum()
             - out_neg["neg_item"].values().sum()).backward()
            if tec is later:
                pending = len(tec._deferred)
                untouched = all(torch.equal(before[n][1], rows_by_id(tec)[n][1]) for n in before)
                assert pending >= 1 and untouched, f"rank {rank} step {step}: backward applied the rows"
                if step % 3 == 2:
                    tec.finish_row_updates()  # otherwise the next lookup must finish them itself
        if step % 3 == 2:
            for name, (ids, rows) in rows_by_id(now).items():
                assert torch.equal(ids, rows_by_id(later)[name][0]) and torch.equal(rows, rows_by_id(later)[name][1])
    later.finish_row_updates()
    torch.save({"now": rows_by_id(now), "later": rows_by_id(later)}, os.path.join(out_dir, f"defer{rank}.pt"))
    dist.destroy_process_group()


def test_deferred_row_updates_give_the_same_rows(tmp_path):
    mp.spawn(_deferring_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    owned = 0
    for r in range(WORLD):
        out = torch.load(tmp_path / f"defer{r}.pt")
        for name, (ids, rows) in out["now"].items():
            owned += ids.numel()
            assert torch.equal(ids, out["later"][name][0]) and torch.equal(rows, out["later"][name][1]), (r, name)
    assert owned > 0
