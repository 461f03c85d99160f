"""`genrec bench sparse`: the store's benches (genrec.sparse.bench) plus `offload_ratio`.

    offload_ratio    training steps/s of the demo-size HSTU tower (configs/demo.toml's
                     [dense]: dim 64, 2 layers, rows of 64 events) over a tiered table
                     10x its host cache, the rest on the SSD tier, against the same steps
                     with every row in memory. A step looks up a batch of Zipf(1.05) ids
                     as the tower's tokens and runs the tower's forward and backward, which
                     updates the rows. The SSD tier's files are evicted from the page cache
                     before the measured steps, and read ahead one step early, as the
                     trainer does: offload_ssd_bytes_read / _written (/proc/self/io) show
                     the disk traffic. Target >= 0.75.

The sparse floor measures the store alone (offload_ratio_store_only, its worst case); this
module adds the tower, which that floor may not import.
"""

from __future__ import annotations

import tempfile

import torch

from genrec.dense import TowerConfig, build_tower
from genrec.sparse import bench as sparse_bench

ROWS_PER_STEP = {True: 32, False: 64}
"""Rows of 64 events per step, by `quick` (the demo trains 64)."""


def _tower_step(rows: int, length: int = 64):
    torch.manual_seed(0)
    tower = build_tower(TowerConfig(kind="hstu", embedding_dim=64, num_layers=2, num_heads=2, attention_dim=32,
                                    linear_dim=32, max_seq_len=length, dropout=0.0))
    offsets_B1 = torch.arange(0, rows * length + 1, length)
    timestamps_T = torch.arange(rows * length) * 60

    def step(tec, ids: torch.Tensor) -> None:
        tokens_TD = tec(sparse_bench._kjt(ids))["f"].values()
        tower(tokens_TD, offsets_B1, timestamps_T).square().mean().backward()
        tower.zero_grad(set_to_none=True)

    return step


def run(quick: bool) -> dict:
    result = sparse_bench.run(quick)
    rows = ROWS_PER_STEP[quick]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the store's benches: one intra-op thread
    try:
        with tempfile.TemporaryDirectory(prefix="genrec_offload_bench_") as root:
            sparse_bench._log("offload with the tower")
            result.update(sparse_bench.bench_offload(
                num_rows=100_000 if quick else 2_000_000, host_rows=10_000 if quick else 200_000,
                batch=rows * 64, steps=6 if quick else 20, root=root, key="offload_ratio",
                step=_tower_step(rows)))
    finally:
        torch.set_num_threads(threads)
    sparse_bench._log(f"offload_ratio {result['offload_ratio']:.3f}")
    return result
