"""Benchmarks of the tiered store. `run(quick)` returns a JSON-able dict; every ratio is
measured side by side in the same process (the machine is shared and noisy).

    hot_path_ratio         lookup + fused row-wise Adagrad of a batch whose rows all sit in
                           the host tier, rows/s, over plain index_select + index_add_ on a
                           dense tensor of the same rows; median of the per-repeat ratios
                           over fresh Zipf(1.05) batches, `*_spread` = median/min/max/n
                           (target >= 0.8)
    hot_path_ratio_default_config   the same with TableConfig's default tiers, TTL on
                           (target >= 0.6)
    rows_per_s_fbgemm_cpu_tbe       fbgemm's CPU TBE, exact row-wise Adagrad, same ids
    index_bytes_per_row    the id index's bytes per materialized row (target <= 16);
                           index_peak_bytes_per_row: the most it held at once
    offload_ratio_store_only   the store's training steps/s (lookup + update, no tower) on
                           a Zipf(1.05) id stream over a table 10x the host cache (the rest
                           on SSD) over the same steps all in memory, the worst case; the SSD
                           tier's files are evicted from the page cache before the measured
                           steps, and offload_store_only_ssd_bytes_read / _written
                           (/proc/self/io over those steps) show the disk traffic they caused.
                           offload_ratio, the same with the demo-size tower in each step,
                           is measured by genrec.models.bench_sparse (this floor imports no
                           dense code)
    ssd_read_rows_per_s    random-slot batch gathers from the SSD tier, median over repeats;
    ssd_write_rows_per_s   number = dim 64, `*_by_dim` = {"64": spread, "128": spread}. The
                           slabs are memory-mapped, so these include the page cache (warm
                           reads / buffered writes).
    incremental_snapshot_ratio   a delta snapshot of a table with 1% of its rows changed
                           (full: 10M rows, quick: 1M; dim 64) over a full snapshot of it,
                           median of pairs (target <= 0.05)
    ssd_read_rows_per_s_cold   the same gathers (their first 2,048 rows, 5 of them) with the
                           tier's files evicted from the page cache before each one;
                           ssd_cold_read_bytes(_per_row): what /proc/self/io counted (the
                           kernel's readahead around each faulting row included)
    scale                  a materialization run (full: 50M rows dim 64; quick: 150k):
                           rows, seconds, RSS (anon = heap, file = mapped SSD slabs), disk
                           bytes, per-tier hit rates of a Zipf phase. Hits count unique ids
                           per step (a hot id counts once per batch), so they understate
                           the per-lookup hit rate.
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .config import SparseConfig, TableConfig
from .module import TieredEmbeddingCollection
from .optim import row_width
from .snapshot import read_manifest
from .tiers import Tier


def _log(msg: str) -> None:
    print(f"[sparse bench] {msg}", file=sys.stderr, flush=True)


def _rss_bytes() -> dict[str, int]:
    out = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "RssAnon", "RssFile")):
                key, val = line.split(":")
                out[key.strip().lower() + "_bytes"] = int(val.split()[0]) * 1024
    return out


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.stat(os.path.join(root, f)).st_blocks * 512  # allocated, not apparent
    return total


def _zipf_sampler(num_ids: int, alpha: float, seed: int):
    """Ids with P(rank k) ~ k^-alpha, ranks scattered over the id space by a permutation."""
    g = torch.Generator().manual_seed(seed)
    cdf = torch.cumsum(torch.arange(1, num_ids + 1, dtype=torch.float64).pow(-alpha), 0)
    cdf /= cdf[-1].clone()
    perm = torch.randperm(num_ids, generator=g)

    def sample(n: int) -> torch.Tensor:
        ranks = torch.searchsorted(cdf, torch.rand(n, generator=g, dtype=torch.float64)).clamp(max=num_ids - 1)
        return perm[ranks]

    return sample


def _kjt(ids: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.tensor([ids.numel()]))


def _materialize(tec: TieredEmbeddingCollection, num_rows: int, chunk: int) -> None:
    """Create rows 0..num_rows as a training step does, then close that step as its
    backward would (there is nothing to apply): a snapshot saved in an open step leaves
    the step's rows to the next delta."""
    for start in range(0, num_rows, chunk):
        _materialize_range(tec, start, min(num_rows, start + chunk))
    tec.stores["t"].close_step()


def _train_step(tec, ids: torch.Tensor) -> None:
    out = tec(_kjt(ids))["f"].values()
    out.backward(torch.ones_like(out))


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _side_by_side(steps: dict, batches: list[torch.Tensor]) -> dict:
    """Time each named step on every batch in turn (fresh ids per repeat, the same ids
    for every side), after one warm-up round. Returns seconds per side and repeat."""
    for fn in steps.values():
        fn(batches[0])
    # Each ground floor (data/, sparse/, dense/) keeps its own timing loop: they import
    # nothing of each other, and no shared place sits below them.
    out = {name: [] for name in steps}
    for ids in batches[1:]:
        for name, fn in steps.items():
            out[name].append(_timed(lambda: fn(ids)))
    return out


def _fbgemm_tbe(num_rows: int, dim: int):
    """fbgemm's CPU table-batched embedding, exact row-wise Adagrad, one row per id: the
    same work as the store's hot path through the library's own kernels."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(num_rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8,
        pooling_mode=PoolingMode.NONE)

    def step(ids: torch.Tensor) -> None:
        out = tbe(ids, torch.arange(ids.numel() + 1, dtype=torch.int64))
        out.backward(torch.ones_like(out))

    return step


def bench_hot_path(num_rows: int, batch: int, dim: int, repeats: int, root: str) -> dict:
    """The store's training step on rows already materialized, against the raw ops of
    the same work on a dense tensor, on fresh Zipf(1.05) ids every repeat:
      hot_path_ratio                 host tier only, no TTL (the store's fastest config)
      hot_path_ratio_default_config  TableConfig's default tiers (device_rows=65536 on
                                     CPU, the rest host), TTL on, event time advancing
    plus fbgemm's CPU TBE (exact row-wise Adagrad) on the same ids, as a named peer.
    num_rows must fit the default tiers (65,536 + 2^20 rows) for the second figure."""
    sample = _zipf_sampler(num_rows, 1.05, seed=3)
    batches = [sample(batch) for _ in range(repeats + 1)]
    tables = {
        "host": TableConfig(name="t", embedding_dim=dim, feature_names=["f"], device_rows=0, host_rows=num_rows),
        "default": TableConfig(name="t", embedding_dim=dim, feature_names=["f"], ttl_seconds=86400),
    }
    tecs = {}
    for name, cfg in tables.items():
        os.makedirs(os.path.join(root, name), exist_ok=True)
        tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_dir=os.path.join(root, name)))
        _materialize(tec, num_rows, 1 << 16)
        assert tec.stores["t"].tiers[2].num_used == 0, "the hot path bench must fit in memory"
        tecs[name] = tec
    dense = torch.randn(num_rows, dim)
    event_time = [0]
    # The trainer freezes its long-lived objects after set-up (Trainer), so the store's
    # Python objects per step do not make the collector rescan the whole process.
    gc.collect()
    gc.freeze()

    def baseline(ids):
        # index_add_ without `alpha`: with it torch takes a per-row path, measured 3.7x
        # slower on these ids, which would flatter the store.
        dense.index_select(0, ids)
        dense.index_add_(0, ids, torch.ones(ids.numel(), dim))

    def default_step(ids):
        event_time[0] += 10
        tecs["default"].set_event_time(event_time[0])
        _train_step(tecs["default"], ids)

    steps = {"baseline": baseline, "host": lambda ids: _train_step(tecs["host"], ids), "default": default_step,
             "fbgemm": _fbgemm_tbe(num_rows, dim)}
    t = _side_by_side(steps, batches)
    gc.unfreeze()  # frozen objects are never freed, not even at exit
    ratio = lambda side: _spread([b / s for b, s in zip(t["baseline"], t[side])])  # noqa: E731
    rows_per_s = lambda side: _spread([batch / s for s in t[side]])  # noqa: E731
    index = tecs["host"].stores["t"].index
    idx_bytes = getattr(index, "nbytes", 0)
    return {
        "hot_path_ratio": ratio("host")["median"], "hot_path_ratio_spread": ratio("host"),
        "hot_path_ratio_default_config": ratio("default")["median"],
        "hot_path_ratio_default_config_spread": ratio("default"),
        "hot_path_rows_per_s": rows_per_s("host")["median"], "hot_path_rows_per_s_spread": rows_per_s("host"),
        "hot_path_baseline_rows_per_s": rows_per_s("baseline")["median"],
        "rows_per_s_fbgemm_cpu_tbe": rows_per_s("fbgemm")["median"],
        "rows_per_s_fbgemm_cpu_tbe_spread": rows_per_s("fbgemm"),
        "fbgemm_cpu_tbe_ratio": ratio("fbgemm")["median"],
        "index_bytes_per_row": idx_bytes / max(len(index), 1),
        "index_peak_bytes_per_row": (index.peak_nbytes() if hasattr(index, "peak_nbytes") else idx_bytes) / max(len(index), 1),
        "hot_path_batch": batch, "hot_path_table_rows": num_rows, "hot_path_repeats": repeats,
        "kernels": tecs["host"].stores["t"].kernels,
    }


def bench_offload(num_rows: int, host_rows: int, batch: int, steps: int, root: str, key: str = "offload_ratio_store_only",
                  step=None, dim: int = 64, repeats: int = 5) -> dict:
    """`key`: steps/s with the table 10x the host cache (the rest on SSD) over the same steps
    with every row in memory, each step `step(tec, ids)` (default: the store's lookup and
    update alone). Both stores warm up on the stream's first `steps` batches, then take turns
    on `repeats` windows of `steps` more, the SSD tier evicted from the page cache before
    each: the ratio is the median window's (`key_spread`). Both call `read_ahead` for step
    t + 1 before step t, as the trainer does (a no-op without SSD rows)."""
    step = step or _train_step
    sample = _zipf_sampler(num_rows, 1.05, seed=1)
    stream = [sample(batch) for _ in range(steps * (repeats + 1))]
    # memory: every row resident in the top tier (nothing ever moves);
    # offload: device cache 1/10 of the host cache, host cache 1/10 of the table, rest SSD.
    tecs = {}
    for mode, device, host in (("memory", num_rows, 0), ("offload", host_rows // 10, host_rows)):
        cfg = TableConfig(name="t", embedding_dim=dim, feature_names=["f"], device_rows=device, host_rows=host)
        mode_dir = os.path.join(root, f"{key}.{mode}")
        os.makedirs(mode_dir, exist_ok=True)
        tecs[mode] = tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_dir=mode_dir))
        _materialize(tec, num_rows, 1 << 16)
        for ids in stream[:steps]:  # warm the caches on the stream's head
            step(tec, ids)
        tec.stores["t"].hits.zero_()
        tec.stores["t"].misses = 0
    times = {mode: [] for mode in tecs}
    io = {mode: {"read_bytes": 0, "write_bytes": 0} for mode in tecs}
    for r in range(1, repeats + 1):
        window = stream[r * steps : (r + 1) * steps]
        for mode, tec in tecs.items():
            tec.stores["t"].tiers[2].drop_page_cache()  # the SSD tier's reads start cold
            io0, t0 = _proc_io(), time.perf_counter()
            for i, ids in enumerate(window):
                if i + 1 < len(window):
                    tec.read_ahead([_kjt(window[i + 1])])
                step(tec, ids)
            times[mode].append(time.perf_counter() - t0)
            for k, v in _proc_io().items():
                io[mode][k] += v - io0[k]
    stats = tecs["offload"].stats()["t"]
    _log(f"{key}: memory {sum(times['memory']):.2f}s, offload {sum(times['offload']):.2f}s {stats} {io['offload']}")
    ratios = _spread([m / o for m, o in zip(times["memory"], times["offload"])])
    prefix = key.replace("offload_ratio", "offload")
    return {key: ratios["median"], f"{key}_spread": ratios, f"{prefix}_stats": stats,
            f"{prefix}_step_ms": 1e3 * statistics.median(times["offload"]) / steps,
            f"{prefix}_memory_step_ms": 1e3 * statistics.median(times["memory"]) / steps,
            f"{prefix}_ssd_bytes_read": io["offload"]["read_bytes"],
            f"{prefix}_ssd_bytes_written": io["offload"]["write_bytes"]}


def _proc_io() -> dict[str, int]:
    """This process's bytes read from and written to storage (Linux /proc/self/io): what
    proves that an SSD-tier figure came from the disk, not the page cache."""
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return {k: int(fields[k]) for k in ("read_bytes", "write_bytes")}


def bench_ssd(num_rows: int, batch: int, repeats: int, root: str) -> dict:
    reads, writes, cold = {}, {}, []
    for dim in (64, 128):
        tier = Tier("ssd", dim + 1, None, torch.device("cpu"), os.path.join(root, f"ssd{dim}"), slab_rows=1 << 18)
        slots = tier.alloc(num_rows)
        for start in range(0, num_rows, 1 << 18):
            s = slots[start : start + (1 << 18)]
            tier.rows.scatter(s, torch.randn(s.numel(), dim + 1))
        g = torch.Generator().manual_seed(dim)
        idx = [slots[torch.randint(0, num_rows, (batch,), generator=g)] for _ in range(repeats)]
        rows = torch.randn(batch, dim + 1)
        reads[str(dim)] = _spread([batch / _timed(lambda: tier.rows.gather(i)) for i in idx])
        writes[str(dim)] = _spread([batch / _timed(lambda: tier.rows.scatter(i, rows)) for i in idx])
        if dim == 64:  # cold: the tier's files evicted from the page cache before each read
            read_before = _proc_io()["read_bytes"]
            cold_rows = min(batch, 2048)  # a cold row costs up to ~128 KB of readahead
            for i in idx[:5]:
                tier.drop_page_cache()
                cold.append(cold_rows / _timed(lambda: tier.rows.gather(i[:cold_rows])))
            cold_bytes = _proc_io()["read_bytes"] - read_before
    return {"ssd_read_rows_per_s": reads["64"]["median"], "ssd_write_rows_per_s": writes["64"]["median"],
            "ssd_read_rows_per_s_cold": _spread(cold)["median"], "ssd_read_rows_per_s_cold_spread": _spread(cold),
            "ssd_cold_read_bytes": cold_bytes, "ssd_cold_read_bytes_per_row": cold_bytes / (cold_rows * len(cold)),
            "ssd_read_rows_per_s_by_dim": reads, "ssd_write_rows_per_s_by_dim": writes}


def bench_scale(num_rows: int, host_rows: int, steps: int, batch: int, root: str) -> dict:
    cfg = TableConfig(name="t", embedding_dim=64, feature_names=["f"], device_rows=host_rows // 8, host_rows=host_rows)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_dir=root, ssd_slab_rows=1 << 20))
    t0 = time.perf_counter()
    chunk = 1 << 20
    for start in range(0, num_rows, chunk):
        _materialize_range(tec, start, min(num_rows, start + chunk))
        if (start // chunk) % 10 == 0:
            _log(f"scale: {start + chunk} / {num_rows} rows, {_rss_bytes()['vmrss_bytes'] >> 20} MiB RSS")
    t_mat = time.perf_counter() - t0
    store = tec.stores["t"]
    store.hits.zero_()
    store.misses = 0
    sample = _zipf_sampler(num_rows, 1.05, seed=2)
    t0 = time.perf_counter()
    for _ in range(steps):
        _train_step(tec, sample(batch))
    t_train = time.perf_counter() - t0
    lookups = max(int(store.hits.sum()) + store.misses, 1)
    return {
        "rows": store.num_rows,
        "row_bytes": row_width(cfg) * 4,
        "materialize_seconds": t_mat,
        "materialize_rows_per_s": num_rows / t_mat,
        "train_steps": steps,
        "train_batch": batch,
        "train_seconds": t_train,
        "hit_rate": {name: h / lookups for name, h in zip(("device", "host", "ssd"), store.hits.tolist())},
        "disk_bytes": _dir_bytes(root),
        "index_bytes": store.index.nbytes,
        "index_bytes_per_row": store.index.nbytes / max(len(store.index), 1),
        **_rss_bytes(),
    }


def bench_snapshot(num_rows: int, repeats: int, root: str) -> dict:
    """A delta snapshot after 1% of the rows changed, against a full snapshot of the same
    table (dim 64, host tier), in pairs: full, train 1% of the ids, delta on that full."""
    cfg = TableConfig(name="t", embedding_dim=64, feature_names=["f"], device_rows=0, host_rows=num_rows)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_dir=root, snapshot_max_deltas=8))
    _materialize(tec, num_rows, 1 << 16)
    g = torch.Generator().manual_seed(4)
    full_s, delta_s, changed = [], [], num_rows // 100
    for r in range(repeats):
        full_dir, delta_dir = os.path.join(root, f"full{r}"), os.path.join(root, f"delta{r}")
        full_s.append(_timed(lambda: tec.save_snapshot(full_dir, full=True)))
        for ids in torch.randperm(num_rows, generator=g)[:changed].split(1 << 16):
            _train_step(tec, ids)
        delta_s.append(_timed(lambda: tec.save_snapshot(delta_dir)))
        manifest = read_manifest(delta_dir)
        assert manifest["kind"] == "delta" and manifest["tables"]["t"]["shards"][0]["num_rows"] == changed
        shutil.rmtree(full_dir)  # the delta keeps its full link (hard links)
        shutil.rmtree(delta_dir)
    ratios = _spread([d / f for d, f in zip(delta_s, full_s)])
    return {"incremental_snapshot_ratio": ratios["median"], "incremental_snapshot_ratio_spread": ratios,
            "snapshot_full_seconds": _spread(full_s), "snapshot_delta_seconds": _spread(delta_s),
            "snapshot_table_rows": num_rows, "snapshot_changed_rows": changed}


def _materialize_range(tec, start: int, stop: int) -> None:
    ids = torch.arange(start, stop)
    tec.stores["t"].lookup_train(ids, torch.ones_like(ids), None)


def run(quick: bool) -> dict:
    root = tempfile.mkdtemp(prefix="genrec_sparse_bench_")
    threads = torch.get_num_threads()
    # One intra-op thread: on a shared, oversubscribed machine multi-threaded index ops
    # were measured 10-20x slower and far noisier than single-threaded ones.
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        result: dict = {"quick": quick, "torch_threads": 1}
        t0 = time.perf_counter()
        _log("hot path")
        result.update(bench_hot_path(num_rows=500_000 if quick else 1_000_000, batch=16384, dim=64,
                                     repeats=31 if quick else 61, root=root))
        _log(f"hot_path_ratio {result['hot_path_ratio']:.3f}")
        _log("offload")
        result.update(bench_offload(num_rows=100_000 if quick else 2_000_000, host_rows=10_000 if quick else 200_000,
                                    batch=4096 if quick else 8192, steps=10 if quick else 40, root=root))
        _log(f"offload_ratio_store_only {result['offload_ratio_store_only']:.3f}")
        _log("ssd")
        result.update(bench_ssd(num_rows=100_000 if quick else 4_000_000, batch=8192 if quick else 16384,
                                repeats=5 if quick else 50, root=root))
        _log("snapshot")
        snapshot_dir = os.path.join(root, "snapshot")
        os.makedirs(snapshot_dir)
        result.update(bench_snapshot(num_rows=1_000_000 if quick else 10_000_000, repeats=5 if quick else 3,
                                     root=snapshot_dir))
        _log(f"incremental_snapshot_ratio {result['incremental_snapshot_ratio']:.3f}")
        _log("scale")
        scale_dir = os.path.join(root, "scale")
        os.makedirs(scale_dir)
        result["scale"] = bench_scale(num_rows=150_000 if quick else 50_000_000,
                                      host_rows=30_000 if quick else 2_000_000,
                                      steps=8 if quick else 200, batch=4096 if quick else 8192, root=scale_dir)
        result["seconds"] = time.perf_counter() - t0
        return result
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
