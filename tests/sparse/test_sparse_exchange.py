"""The grouped exchange's first all-to-all carries its split counts in a block of a shared
capacity: 3 gloo ranks whose id counts grow, shrink, overflow on one rank only and drop
to zero must receive exactly what the exchange with counts sent ahead delivers, make the
same number of all-to-alls on every rank, and agree on the capacity."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genrec.sparse.module import _Capacity, _Exchange

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
        want = _Exchange(ids, dist.group.WORLD, payload)  # the counts first, then the payload
        record.append({"got": got.payload_R, "want": want.payload_R, "recv": got.recv_list,
                       "want_recv": want.recv_list, "send": want.send_list, "capacity": capacity.rows})
    dist.all_to_all_single = real
    torch.save({"record": record, "calls": calls[0::2]}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
