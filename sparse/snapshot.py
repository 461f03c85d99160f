"""Snapshots of the tiered store (save / load, reshardable) and quantized export for serving.

Layout of a snapshot directory:

    <dir>/MANIFEST.json                      the commit record: version, world size, tables,
                                             per shard file names, sizes and CRC32s
    <dir>/v<version>/<table>.rank<r>.ids.bin       int64 [N]      row ids of rank r's shard
    <dir>/v<version>/<table>.rank<r>.rows.bin      fp32 [N, W]    values + optimizer state
    <dir>/v<version>/<table>.rank<r>.meta.bin      int64 [N, 3]   last access step, count, last update
    <dir>/v<version>/<table>.rank<r>.pending_ids.bin / pending_counts.bin   admission counters

Atomicity: shard files go to a fresh version folder; the manifest is replaced last by
rename, and older version folders are deleted only after that. A crash at any moment
leaves MANIFEST.json naming a complete, older version. Consistency: a snapshot is taken
between steps; a row and its optimizer state are one packed row, so they cannot tear.
Resharding: a rank loading the snapshot reads every shard's ids and keeps the rows it
owns under the current world size (splitmix64(id) % world_size).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .hashing import owner_rank

MANIFEST = "MANIFEST.json"
_CHUNK_BYTES = 1 << 24
_LOAD_CHUNK_ROWS = 1 << 20


def _fsync_dir(path: str) -> None:
    # A copy of genrec.data.files.fsync_path: the ground floors (data/, sparse/, dense/)
    # import nothing from each other, and no shared place sits below them.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Writer:
    """Append tensors' raw bytes to `path`.tmp with a running CRC32; `close` fsyncs and
    renames into place, so a reader never sees a partial file under the final name."""

    def __init__(self, path: str) -> None:
        self.path, self.crc, self.bytes = path, 0, 0
        self.f = open(path + ".tmp", "wb")

    def write(self, t: torch.Tensor) -> None:
        data = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
        for start in range(0, len(data), _CHUNK_BYTES):
            chunk = data[start : start + _CHUNK_BYTES]
            self.crc = zlib.crc32(chunk, self.crc)
            self.f.write(chunk)
        self.bytes += len(data)

    def close(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.path + ".tmp", self.path)
        return {"file": os.path.basename(self.path), "bytes": self.bytes, "crc32": self.crc}


def _write_tensor(path: str, t: torch.Tensor) -> dict:
    """Write a tensor's raw bytes atomically; return {"file", "bytes", "crc32"}."""
    w = _Writer(path)
    w.write(t)
    return w.close()


def _verify(path: str, info: dict) -> None:
    if not os.path.exists(path):
        raise ValueError(f"snapshot file {path} is missing")
    size = os.path.getsize(path)
    if size != info["bytes"]:
        raise ValueError(f"snapshot file {path} is truncated or corrupt: {size} bytes, manifest says {info['bytes']}")
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    if crc != info["crc32"]:
        raise ValueError(f"snapshot file {path} is corrupt: CRC32 {crc:#x}, manifest says {info['crc32']:#x}")


def _read(path: str, dtype, width: int | None, start: int = 0, count: int | None = None) -> torch.Tensor:
    itemsize = np.dtype(dtype).itemsize * (width or 1)
    with open(path, "rb") as f:
        f.seek(start * itemsize)
        arr = np.fromfile(f, dtype=dtype, count=-1 if count is None else count * (width or 1))
    t = torch.from_numpy(arr)
    return t.view(-1, width) if width else t


def _dist(module) -> tuple[int, int]:
    return module.rank, module.world_size


def save_snapshot(module, path: str) -> list[str]:
    """Write every table's shard of this rank; collective when the module is distributed.
    Returns the paths of the files this rank wrote (rank 0: the manifest too)."""
    rank, world = _dist(module)
    token = [f"{time.time_ns():x}{os.getpid():x}"]
    if world > 1:
        dist.broadcast_object_list(token, src=0, group=module.group)
    version = token[0]
    vdir = os.path.join(path, f"v{version}")
    try:
        os.makedirs(vdir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create snapshot directory {vdir}: {e}") from None
    shards, written = {}, []
    for name, store in module.stores.items():
        stem = os.path.join(vdir, f"{name}.rank{rank}")
        writers = {k: _Writer(f"{stem}.{k}.bin") for k in ("ids", "rows", "meta")}
        num_rows = 0
        for ids_n, rows_nW, meta_n3 in store.iter_rows():  # slab by slab: bounded memory
            writers["ids"].write(ids_n)
            writers["rows"].write(rows_nW)
            writers["meta"].write(meta_n3)
            num_rows += int(ids_n.numel())
        p_ids, p_counts = store.pending.items()
        files = {k: w.close() for k, w in writers.items()}
        files["pending_ids"] = _write_tensor(stem + ".pending_ids.bin", p_ids)
        files["pending_counts"] = _write_tensor(stem + ".pending_counts.bin", p_counts)
        shards[name] = {"rank": rank, "num_rows": num_rows, "num_pending": int(p_ids.numel()),
                        "step": store.step, "files": files}
        written += [os.path.join(vdir, f["file"]) for f in files.values()]
    gathered = [shards]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, shards, group=module.group)
    if rank == 0:
        _fsync_dir(vdir)
        manifest = {
            "format": "genrec.sparse.snapshot/1",
            "version": version,
            "world_size": world,
            "event_time": module.event_time,
            "tables": {
                name: {
                    "embedding_dim": t.embedding_dim,
                    "optimizer": t.optimizer,
                    "row_width": module.stores[name].width,
                    "shards": [g[name] for g in gathered],
                }
                for name, t in module.tables.items()
            },
        }
        tmp = os.path.join(path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MANIFEST))  # the commit point
        written.append(os.path.join(path, MANIFEST))
        _fsync_dir(path)
        for entry in os.listdir(path):
            if entry.startswith("v") and entry != f"v{version}" and os.path.isdir(os.path.join(path, entry)):
                shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
    if world > 1:
        dist.barrier(group=module.group)
    return written


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise ValueError(f"no snapshot at {path}: {MANIFEST} is missing")
    try:
        with open(mpath) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"snapshot manifest {mpath} is corrupt: {e}") from None


def load_snapshot(module, path: str) -> None:
    """Replace every table's rows with the snapshot's rows owned by this rank.

    All files are checked (size, CRC32) and all tables' shapes compared before any
    table is touched, so a bad snapshot leaves the store as it was."""
    rank, world = _dist(module)
    manifest = read_manifest(path)
    vdir = os.path.join(path, f"v{manifest['version']}")
    for name, t in module.tables.items():
        if name not in manifest["tables"]:
            raise ValueError(f"snapshot {path} has no table {name!r} (has {sorted(manifest['tables'])})")
        entry = manifest["tables"][name]
        if entry["embedding_dim"] != t.embedding_dim:
            raise ValueError(
                f"snapshot {path}: table {name!r} has embedding_dim {entry['embedding_dim']}, config says {t.embedding_dim}"
            )
        if entry["row_width"] != module.stores[name].width or entry["optimizer"] != t.optimizer:
            raise ValueError(
                f"snapshot {path}: table {name!r} was saved with optimizer {entry['optimizer']!r}, config says {t.optimizer!r}"
            )
        for shard in entry["shards"]:
            for info in shard["files"].values():
                _verify(os.path.join(vdir, info["file"]), info)
    for name, store in module.stores.items():
        entry = manifest["tables"][name]
        store.clear()
        store.step = (1 << 63) - 1  # nothing is protected from eviction while loading
        for shard in entry["shards"]:
            files = {k: os.path.join(vdir, v["file"]) for k, v in shard["files"].items()}
            n = shard["num_rows"]
            for start in range(0, n, _LOAD_CHUNK_ROWS):
                count = min(_LOAD_CHUNK_ROWS, n - start)
                ids = _read(files["ids"], np.int64, None, start, count)
                mine = (owner_rank(ids, world) == rank).nonzero().squeeze(1)
                if mine.numel() == 0:
                    continue
                rows = _read(files["rows"], np.float32, store.width, start, count)[mine]
                meta = _read(files["meta"], np.int64, 3, start, count)[mine]
                store._place(ids[mine], rows.to(store.device), meta, 0)
            p_ids = _read(files["pending_ids"], np.int64, None)
            p_counts = _read(files["pending_counts"], np.int64, None)
            mine = owner_rank(p_ids, world) == rank
            store.pending.insert_new(p_ids[mine], p_counts[mine])
        store.step = max([0] + [s["step"] for s in entry["shards"]])
        store.last_sweep = None
    module.event_time = manifest["event_time"]


# ---------------------------------------------------------------------- export


@dataclass
class QuantizedTable:
    """One table's exported shard. int8: values = q * scale + bias (q uint8, per row);
    fp16: rows are fp16 and scale_bias is None."""

    ids_N: torch.Tensor
    """int64 [N], sorted ascending (the serving id index: searchsorted)."""
    rows_ND: torch.Tensor
    """uint8 or float16 [N, D]."""
    scale_bias_N2: torch.Tensor | None
    """float32 [N, 2] (scale, bias) per row for int8; None for fp16."""

    def dequantize(self) -> torch.Tensor:
        if self.scale_bias_N2 is None:
            return self.rows_ND.float()
        return self.rows_ND.float() * self.scale_bias_N2[:, :1] + self.scale_bias_N2[:, 1:]


def quantize_rows(values_ND: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row-wise quantization: "fp16", or "int8" asymmetric uint8 with fp32 scale and bias
    per row (FBGEMM's fused 8-bit row-wise layout, kept as two arrays)."""
    if dtype == "fp16":
        return values_ND.to(torch.float16), None
    if dtype != "int8":
        raise ValueError(f"export dtype must be 'fp16' or 'int8', got {dtype!r}")
    lo_N1 = values_ND.min(dim=1, keepdim=True).values
    hi_N1 = values_ND.max(dim=1, keepdim=True).values
    scale_N1 = ((hi_N1 - lo_N1) / 255.0).clamp(min=1e-12)
    q_ND = torch.round((values_ND - lo_N1) / scale_N1).clamp(0, 255).to(torch.uint8)
    return q_ND, torch.cat([scale_N1, lo_N1], dim=1)


def export_quantized(module, dtype: str = "int8", out_dir: str | None = None) -> dict[str, QuantizedTable]:
    """Quantize this rank's rows of every table; with out_dir, also write
    `<table>.rank<r>.{ids,rows,scale_bias}.bin` and `export.rank<r>.json` (sizes, CRC32s)."""
    rank, _ = _dist(module)
    result, files = {}, {}
    for name, store in module.stores.items():
        ids_N, rows_NW, _ = store.all_rows()
        order = torch.argsort(ids_N)
        q_ND, sb_N2 = quantize_rows(rows_NW[order, : store.dim], dtype)
        result[name] = QuantizedTable(ids_N=ids_N[order], rows_ND=q_ND, scale_bias_N2=sb_N2)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        for name, qt in result.items():
            stem = os.path.join(out_dir, f"{name}.rank{rank}")
            files[name] = {
                "dtype": dtype,
                "embedding_dim": module.tables[name].embedding_dim,
                "num_rows": int(qt.ids_N.numel()),
                "ids": _write_tensor(stem + ".ids.bin", qt.ids_N),
                "rows": _write_tensor(stem + ".rows.bin", qt.rows_ND.view(torch.uint8) if dtype == "int8" else qt.rows_ND),
            }
            if qt.scale_bias_N2 is not None:
                files[name]["scale_bias"] = _write_tensor(stem + ".scale_bias.bin", qt.scale_bias_N2)
        tmp = os.path.join(out_dir, f"export.rank{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"format": "genrec.sparse.export/1", "rank": rank, "tables": files}, f, indent=1)
        os.replace(tmp, os.path.join(out_dir, f"export.rank{rank}.json"))
    return result
