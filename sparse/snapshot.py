"""Snapshots of the tiered store (save / load, reshardable).

Layout of a snapshot directory:

    <dir>/MANIFEST.json                      the commit record: version, world size, tables,
                                             per shard row counts, file names, sizes and
                                             CRC32s, and a CRC32 of the manifest itself
    <dir>/v<version>/<table>.rank<r>.ids.bin       int64 [N]      row ids of rank r's shard
    <dir>/v<version>/<table>.rank<r>.rows.bin      fp32 [N, W]    values + optimizer state
    <dir>/v<version>/<table>.rank<r>.meta.bin      int64 [N, 3]   last access step, count, last update
    <dir>/v<version>/<table>.rank<r>.pending_ids.bin    int64 [P]      admission counters: ids
    <dir>/v<version>/<table>.rank<r>.pending_state.bin  int64 [P, 3]   sightings, last seen time, step

Incremental snapshots (SparseConfig.snapshot_max_deltas > 0). A snapshot is a chain of
links, oldest first: one full link, then deltas. A delta link writes, per shard, only the
rows looked up since the snapshot it builds on (their ids, rows and metadata: a row
changes only through a training lookup and the optimizer step after it), the ids removed
since then (`<table>.rank<r>.removed.bin`, int64 [R]) and the whole admission-counter map.
The older links' files are hard links into this snapshot's folder (copies where the
filesystem has no hard links), so each snapshot folder holds its whole chain: deleting an
older snapshot (a pruned checkpoint) never breaks a later one. The manifest lists the
older links under "chain" (version, kind, shards per table) and the newest one as usual.
Loading applies the links in order: the full one, then each delta's removals and rows
(newer rows replace older ones). After `snapshot_max_deltas` deltas the next snapshot is
full again (compaction), as is one taken after a load under another world size or when
the snapshot it would build on is gone.

Atomicity: shard files go to a fresh version folder; every file, the version folder and
the snapshot folder are fsynced, then the manifest is replaced by rename (the commit)
and older version folders are deleted only after that. A crash at any moment leaves
MANIFEST.json naming a complete, older version. Consistency: a snapshot is taken
between steps; a row and its optimizer state are one packed row, so they cannot tear.

Loading: each table is read into a staging store beside the live one (each file's size
checked against the manifest and its row count first, its CRC32 while it streams by);
only once every rank has read everything do the stores take the staged rows, so a
failed load (bad file, I/O error, full disk) leaves every store as it was.
Resharding: rows live on rank splitmix64(id) % world_size. Under the saved world size S
and the current W, rank r reads only the shards s with s = r (mod gcd(S, W)), the only
ones that can hold its ids: its own shard when S == W; and it filters ids by owner only
when W does not divide S.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import zlib

import torch
import torch.distributed as dist

from .admission import NUM_STATE
from .hashing import owner_rank
from .tiers import NUM_META

MANIFEST = "MANIFEST.json"
FORMAT = "genrec.sparse.snapshot/2"
CHECKSUM_KEY = "manifest_crc32"
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


def manifest_checksum(manifest: dict) -> int:
    """CRC32 of the manifest's canonical JSON (sorted keys, no spaces), without its own
    checksum field: a manifest edited or torn into other valid JSON is refused."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


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


class _ShardFile:
    """One shard file, read front to back in records of a fixed size. Its size is checked
    against the manifest and the row count when made (before anything is read), its CRC32
    by `finish` once every byte went by (one pass over the data, not a verify pass too)."""

    def __init__(self, vdir: str, info: dict, record_bytes: int, num_records: int, count_key: str) -> None:
        self.path, self.info, self.crc, self.f = os.path.join(vdir, info["file"]), info, 0, None
        if not os.path.exists(self.path):
            raise ValueError(f"snapshot file {self.path} is missing")
        size = os.path.getsize(self.path)
        if size != info["bytes"]:
            raise ValueError(f"snapshot file {self.path} is truncated or corrupt: {size} bytes, "
                             f"manifest says {info['bytes']}")
        if size != record_bytes * num_records:
            raise ValueError(f"snapshot file {self.path} holds {size} bytes, but the manifest's {count_key} = "
                             f"{num_records} needs {record_bytes * num_records}")

    def read(self, count: int, dtype: torch.dtype, width: int | None) -> torch.Tensor:
        if self.f is None:
            self.f = open(self.path, "rb")
        out = torch.empty((count, width) if width else (count,), dtype=dtype)
        buf = memoryview(out.view(-1).view(torch.uint8).numpy())
        got = self.f.readinto(buf)
        if got != len(buf):
            raise ValueError(f"snapshot file {self.path} is truncated: it ended while being read")
        self.crc = zlib.crc32(buf, self.crc)
        return out

    def finish(self) -> None:
        if self.crc != self.info["crc32"]:
            raise ValueError(
                f"snapshot file {self.path} is corrupt: CRC32 {self.crc:#x}, manifest says {self.info['crc32']:#x}")

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _dist(module) -> tuple[int, int]:
    return module.rank, module.world_size


def _links(manifest: dict) -> list[dict]:
    """The snapshot's links, oldest first: {"version", "kind", "shards": {table: [shard]}}."""
    newest = {"version": manifest["version"], "kind": manifest.get("kind", "full"),
              "shards": {name: t["shards"] for name, t in manifest["tables"].items()}}
    return [*manifest.get("chain", []), newest]


def _delta_base(module, world: int, max_deltas: int) -> tuple[str, list[dict]] | None:
    """(folder, links) of the snapshot a delta can build on, or None for a full snapshot:
    the last one this module saved or loaded, still there, of this world size, with fewer
    than `max_deltas` deltas."""
    last = module.last_snapshot
    if max_deltas <= 0 or last is None:
        return None
    base_path, base_version = last
    try:
        manifest = read_manifest(base_path)
    except ValueError:
        return None
    links = _links(manifest)
    if manifest["version"] != base_version or manifest["world_size"] != world or len(links) > max_deltas:
        return None
    return base_path, links


def _link_file(src: str, dst: str) -> None:
    """dst names the same bytes as src: a hard link, or a copy where links are refused."""
    if os.path.exists(dst):
        return
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or none with hard links (EXDEV, EPERM, ENOTSUP)
        shutil.copyfile(src, dst + ".tmp")
        with open(dst + ".tmp", "rb") as f:
            os.fsync(f.fileno())
        os.replace(dst + ".tmp", dst)


_VERSION_DIR = re.compile(r"v[0-9a-f]+")
_SHARD_FILE = re.compile(r".+\.rank\d+\.[a-z_]+\.bin(\.tmp)?")


def _is_version_dir(path: str) -> bool:
    """Whether `path` is a version folder a save wrote (its name, and only shard files in
    it): an older one is removed once the manifest no longer names it; anything else that
    shares the snapshot's folder stays."""
    if not (_VERSION_DIR.fullmatch(os.path.basename(path)) and os.path.isdir(path)):
        return False
    with os.scandir(path) as entries:
        return all(e.is_file(follow_symlinks=False) and _SHARD_FILE.fullmatch(e.name) for e in entries)


def _error(failure: OSError | None) -> tuple[int | None, str] | None:
    """An OSError as it travels to the other ranks: (errno, message)."""
    return None if failure is None else (failure.errno, str(failure))


def save_snapshot(module, path: str, *, max_deltas: int = 0) -> list[str]:
    """Write every table's shard of this rank; collective when the module is distributed.
    `max_deltas` > 0: a delta on the last snapshot saved or loaded where one can be (see
    the module doc). Returns the paths of the files this rank wrote (rank 0: the manifest
    too), not the older links' files it linked: the manifest's sizes and CRC32s cover those.
    An OSError on any rank (a full disk) raises OSError on every rank, each past its last
    collective of the save, and leaves the last manifest as it was."""
    module.finish_row_updates()  # deferred row updates belong to the state being saved
    rank, world = _dist(module)
    known = [all(store.removals_known for store in module.stores.values())]
    if world > 1 and max_deltas > 0:  # a delta needs every rank's removals since the base
        mine, known = known[0], [None] * world
        dist.all_gather_object(known, mine, group=module.group)
    base = _delta_base(module, world, max_deltas) if rank == 0 and all(known) else None
    token = [f"{time.time_ns():x}{os.getpid():x}", base]
    if world > 1:  # every rank writes the same kind of link
        dist.broadcast_object_list(token, src=0, group=module.group)
    version, base = token
    vdir = os.path.join(path, f"v{version}")
    shards, written, failure = {}, [], None
    try:
        try:
            os.makedirs(vdir, exist_ok=True)
        except OSError as e:
            if world == 1:  # no rank to wait for it
                raise ValueError(f"cannot create snapshot directory {vdir}: {e}") from None
            # A full disk can refuse the folder on one rank: the others learn it at the gather.
            raise OSError(e.errno, f"cannot create snapshot directory {vdir}: {e.strerror}") from None
        for name, store in module.stores.items():
            stem = os.path.join(vdir, f"{name}.rank{rank}")
            writers = {k: _Writer(f"{stem}.{k}.bin") for k in ("ids", "rows", "meta")}
            num_rows = 0
            rows = store.iter_rows(changed_only=base is not None)
            for ids_n, rows_nW, meta_n3 in rows:  # slab by slab: bounded memory
                writers["ids"].write(ids_n)
                writers["rows"].write(rows_nW)
                writers["meta"].write(meta_n3)
                num_rows += int(ids_n.numel())
            p_ids, p_state = store.pending.items()
            files = {k: w.close() for k, w in writers.items()}
            files["pending_ids"] = _write_tensor(stem + ".pending_ids.bin", p_ids)
            files["pending_state"] = _write_tensor(stem + ".pending_state.bin", p_state)
            shards[name] = {"rank": rank, "num_rows": num_rows, "num_pending": int(p_ids.numel()),
                            "step": store.step, "last_sweep": store.last_sweep, "files": files}
            if base is not None:
                removed = store.removed_ids()
                files["removed"] = _write_tensor(stem + ".removed.bin", removed)
                shards[name]["num_removed"] = int(removed.numel())
            written += [os.path.join(vdir, f["file"]) for f in files.values()]
        if base is not None:  # this rank's files of the older links, into this folder
            base_path, links = base
            for link in links:
                src_dir, dst_dir = (os.path.join(p, f"v{link['version']}") for p in (base_path, path))
                os.makedirs(dst_dir, exist_ok=True)
                for name in module.stores:
                    for info in link["shards"][name][rank]["files"].values():
                        _link_file(os.path.join(src_dir, info["file"]), os.path.join(dst_dir, info["file"]))
                _fsync_dir(dst_dir)
        # The files' own fsyncs do not cover their names: the folder's entries must be durable
        # before the manifest that names them can be.
        _fsync_dir(vdir)
    except OSError as e:  # a full disk, an I/O error: every rank learns it at the gather below
        failure = e
    # The gather carries each rank's outcome with its shards: a rank whose writes failed
    # still takes part, so no rank waits in a collective the failed one never reaches.
    gathered = [(shards, _error(failure))]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (shards, _error(failure)), group=module.group)
    errors = [(r, error) for r, (_, error) in enumerate(gathered) if error is not None]
    if errors:
        if failure is not None:
            raise failure
        r, (code, text) = errors[0]
        raise OSError(code, f"snapshot {path}: rank {r}: {text}")
    gathered = [g for g, _ in gathered]
    if rank == 0:
        try:
            # The version folder's entry in `path`, and `path`'s own if this save created it.
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
            _fsync_dir(path)
            manifest = {
                "format": FORMAT,
                "version": version,
                "kind": "full" if base is None else "delta",
                "chain": [] if base is None else base[1],
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
            manifest[CHECKSUM_KEY] = manifest_checksum(manifest)
            tmp = os.path.join(path, MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(path, MANIFEST))  # the commit point
            written.append(os.path.join(path, MANIFEST))
            _fsync_dir(path)
            keep = {f"v{link['version']}" for link in _links(manifest)}
            for entry in os.listdir(path):
                if entry not in keep and _is_version_dir(os.path.join(path, entry)):
                    shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
        except OSError as e:
            failure = e
    if world > 1:  # the barrier after the commit, which tells every rank whether rank 0 made it
        box = [_error(failure)]
        dist.broadcast_object_list(box, src=0, group=module.group)
        if box[0] is not None and failure is None:
            raise OSError(box[0][0], f"snapshot {path}: rank 0: {box[0][1]}")
    if failure is not None:
        raise failure
    for store in module.stores.values():
        store.mark_snapshot()
    module.last_snapshot = (os.path.abspath(path), version)
    return written


def read_manifest(path: str) -> dict:
    """The manifest of the snapshot at `path`, its format and own checksum verified."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise ValueError(f"no snapshot at {path}: {MANIFEST} is missing")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"snapshot manifest {mpath} is corrupt: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"snapshot manifest {mpath} has format {found!r}; this version reads {FORMAT!r}")
    crc = manifest_checksum(manifest)
    if manifest.get(CHECKSUM_KEY) != crc:
        raise ValueError(f"snapshot manifest {mpath} is corrupt: checksum {manifest.get(CHECKSUM_KEY)!r} "
                         f"recorded, {crc} computed")
    return manifest


def _check_tables(module, manifest: dict, path: str) -> None:
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


def _shard_files(vdir: str, shard: dict, width: int, *, delta: bool, pending: bool) -> dict[str, _ShardFile]:
    """The shard's files to read: its rows (and a delta's removals), and the admission
    counters where `pending` (the newest link's: each link holds the whole map)."""
    n, p, files = shard["num_rows"], shard["num_pending"], shard["files"]
    out = {
        "ids": _ShardFile(vdir, files["ids"], 8, n, "num_rows"),
        "rows": _ShardFile(vdir, files["rows"], 4 * width, n, "num_rows"),
        "meta": _ShardFile(vdir, files["meta"], 8 * NUM_META, n, "num_rows"),
    }
    if delta:
        if "removed" not in files:
            raise ValueError(f"snapshot {vdir}: a delta shard lists no removed-ids file")
        out["removed"] = _ShardFile(vdir, files["removed"], 8, shard["num_removed"], "num_removed")
    if pending:
        out["pending_ids"] = _ShardFile(vdir, files["pending_ids"], 8, p, "num_pending")
        out["pending_state"] = _ShardFile(vdir, files["pending_state"], 8 * NUM_STATE, p, "num_pending")
    return out


def _stage_shard(staged, files: dict[str, _ShardFile], shard: dict, rank: int, world: int, filter_ids: bool) -> None:
    """Read one shard of one link into a staging store: the rows and counters this rank
    owns. A delta's removals go first, and its rows replace the staged ones of their ids."""
    n, p = shard["num_rows"], shard["num_pending"]
    delta = "removed" in files
    mine = lambda ids: (owner_rank(ids, world) == rank).nonzero().squeeze(1)  # noqa: E731
    try:
        if delta:
            removed = files["removed"].read(shard["num_removed"], torch.int64, None)
            staged.unstage(removed[mine(removed)] if filter_ids else removed)
        for start in range(0, n, _LOAD_CHUNK_ROWS):
            count = min(_LOAD_CHUNK_ROWS, n - start)
            ids = files["ids"].read(count, torch.int64, None)
            rows = files["rows"].read(count, torch.float32, staged.width)
            meta = files["meta"].read(count, torch.int64, NUM_META)
            if filter_ids:
                keep = mine(ids)
                ids, rows, meta = ids[keep], rows[keep], meta[keep]
            if delta:
                staged.unstage(ids)
            staged.stage(ids, rows, meta)
        if "pending_ids" in files:
            p_ids = files["pending_ids"].read(p, torch.int64, None)
            p_state = files["pending_state"].read(p, torch.int64, NUM_STATE)
            if filter_ids:
                keep = mine(p_ids)
                p_ids, p_state = p_ids[keep], p_state[keep]
            staged.pending.insert_new(p_ids, p_state)
        for f in files.values():
            f.finish()
    finally:
        for f in files.values():
            f.close()


def load_snapshot(module, path: str) -> None:
    """Replace every table's rows, counters and step with the snapshot's (the part this
    rank owns) and the module's event time with the snapshot's; collective when
    distributed. On any error every store is left as it was (see the module doc)."""
    rank, world = _dist(module)
    manifest = read_manifest(path)
    _check_tables(module, manifest, path)
    links = _links(manifest)
    if links[0]["kind"] != "full" or any(link["kind"] != "delta" for link in links[1:]):
        raise ValueError(f"snapshot {path}: its chain must be one full link, then deltas "
                         f"(has {[link['kind'] for link in links]})")
    saved_world = manifest["world_size"]
    common = math.gcd(saved_world, world)
    my_shards = [s for s in range(saved_world) if s % common == rank % common]
    filter_ids = saved_world % world != 0
    staged, error = {}, None
    try:
        # Every size and row count first: a bad snapshot fails before gigabytes are read.
        files = {name: [[_shard_files(os.path.join(path, f"v{link['version']}"), link["shards"][name][s], store.width,
                                      delta=i > 0, pending=i == len(links) - 1) for s in my_shards]
                        for i, link in enumerate(links)]
                 for name, store in module.stores.items()}
        for name, store in module.stores.items():
            shards = manifest["tables"][name]["shards"]
            staged[name] = store.staging()
            for link, link_files in zip(links, files[name]):
                for s, shard_files in zip(my_shards, link_files):
                    _stage_shard(staged[name], shard_files, link["shards"][name][s], rank, world, filter_ids)
            staged[name].step = max(sh["step"] for sh in shards)
            sweeps = [sh["last_sweep"] for sh in shards if sh["last_sweep"] is not None]
            staged[name].last_sweep = max(sweeps) if sweeps else None
    except Exception as e:
        error = e
    failed = [error is not None]
    if world > 1:  # all ranks take the snapshot or none does
        failed = [None] * world
        dist.all_gather_object(failed, error is not None, group=module.group)
    if any(failed):
        for s in staged.values():
            s.destroy()
        if error is not None:
            raise error
        raise ValueError(f"loading snapshot {path} failed on rank(s) {[r for r, f in enumerate(failed) if f]}; "
                         f"every store is unchanged")
    for name, store in module.stores.items():
        store.adopt(staged[name])
    module.event_time = manifest["event_time"]
    module.last_snapshot = (os.path.abspath(path), manifest["version"])

