"""Out-of-core `prepare`: event logs (parquet) -> per-user, time-ordered sequences, split.

Worked example (FeatureSpec sparse = ["item_id", "action"], labels = ["click"]), one user:

    log rows (any order, any file):      user 7: (ts 100, item 11), (ts 160, item 12),
                                                 (ts 200, item 13), (ts 250, item 14)
    leave-one-out output, one row per user (list columns aligned event by event):
        train/  user_id 7  item_id [11, 12]          ts [100, 160]            seq[:-2]
        valid/  user_id 7  item_id [11, 12, 13]      ts [100, 160, 200]       seq[:-1], last = target
        test/   user_id 7  item_id [11, 12, 13, 14]  ts [100, 160, 200, 250]  seq,      last = target
    time split (train_cutoff_ts 180, valid_cutoff_ts 240):
        train/  item_id [11, 12]            events with ts < 180
        valid/  item_id [11, 12, 13]        events < 180, then the first event in [180, 240) = target
        test/   item_id [11, 12, 13, 14]    events < 240, then the first event >= 240 = target
      (without valid_cutoff_ts there is no valid/ rows and test/ = events < 180 + first event >= 180)

Every output row is a prefix of its user's time-ordered sequence; in valid/ and test/ the
last event of the row is the held-out target and everything before it is the history.
Leave-one-out users with fewer than 3 events go to train/ whole and are counted
(`users_train_only`); time-split evaluation rows need at least one history event
(the rest are counted as `eval_users_without_history`). Ties in ts keep log order
(files in sorted path order, rows in file order).

Output directory (manifest.json: format, features, split, schema, counts of users /
items / rows and events per split, settings, sources with size + sha256, outputs with
size + sha256):

    out_dir/manifest.json
    out_dir/items.parquet                    item_id int64, count int64 (train events), by count desc
    out_dir/{train,valid,test}/part-NNNNN.parquet
        user_id int64, <sparse...> list<int64>, ts list<int64>, <labels...> list<int8>

Out of core: pass 1 streams each file row group by row group, hashes string ids, and
appends fixed-width records to one spill file per hash bucket of the user key; pass 2
loads one bucket at a time, sorts it by (user, ts) and writes the list columns. The number
of buckets comes from the row count in the parquet footers and `memory_budget_mb`, so peak
memory (about `memory_budget_mb`) does not grow with the log: 100M synthetic events
(2M users, 3.6M items) prepared with a 1,024 MB budget peaked at 1.02 GB RSS. What can still grow: the
distinct-item counts (16 bytes per item), the largest input row group, and a single user
with more events than a bucket holds.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from genrec.data.config import FeatureSpec
from genrec.data.files import atomic_write_text, claim_output_dir, publish_dir, sha256_file, staging_dir
from genrec.data.logfiles import check_consistent_types, open_log, resolve_paths, row_groups
from genrec.data.schema import hash_string_ids

FORMAT_VERSION = "genrec.sequences/1"
MANIFEST = "manifest.json"
USER_COLUMN = "user_id"
TS_COLUMN = "ts"
SPLITS = ("train", "valid", "test")

# Rows per pass-1 record batch: large enough to amortize the per-batch bucket partition,
# small enough (~10 MB of records) to be noise next to the memory budget.
_PASS1_BATCH_ROWS = 1 << 17
# Pass 2 holds a bucket's records roughly this many times over (loaded, sorted columns,
# the three split tables written concurrently, encoder buffers) plus 16 bytes of sort
# index per row.
_PASS2_COPIES = 6
_MAX_BUCKETS = 4096
_RESERVED_MB = 256
# A row group never holds more than one bucket's users, so larger values all act alike; the
# bound keeps the value far inside what pyarrow takes (a C long).
_MAX_ROW_GROUP_USERS = 1 << 31
# Descriptors besides the spill files (pass 1) or the split writers (pass 2): the
# interpreter's, the shared libraries', the log being read, the staging folder.
_SPARE_FILES = 64


@dataclass(kw_only=True)
class SplitConfig:
    """How events are split into train / valid / test rows."""

    kind: Literal["leave_one_out", "time"] = "leave_one_out"
    """leave_one_out: last event test, second-last valid, rest train (per user).
    time: train on events before `train_cutoff_ts`, evaluate on the first event after."""
    train_cutoff_ts: int | None = None
    """time split: train/ holds events with ts < this (required for kind = time)."""
    valid_cutoff_ts: int | None = None
    """time split: end of the validation window; valid/ targets lie in
    [train_cutoff_ts, valid_cutoff_ts), test/ targets at or after it. None: no valid/ rows,
    test/ targets are the first event at or after train_cutoff_ts."""
    min_user_events: int = 1
    """Users with fewer events in the whole log are dropped (and counted)."""

    def validate(self) -> None:
        if self.min_user_events < 1:
            raise ValueError(f"split.min_user_events must be >= 1, got {self.min_user_events}")
        if self.kind == "leave_one_out":
            if self.train_cutoff_ts is not None or self.valid_cutoff_ts is not None:
                raise ValueError("split.train_cutoff_ts / valid_cutoff_ts only apply to kind = 'time'")
        elif self.kind == "time":
            if self.train_cutoff_ts is None:
                raise ValueError("split.kind = 'time' needs split.train_cutoff_ts")
            if self.valid_cutoff_ts is not None and self.valid_cutoff_ts <= self.train_cutoff_ts:
                raise ValueError(
                    f"split.valid_cutoff_ts ({self.valid_cutoff_ts}) must be after "
                    f"split.train_cutoff_ts ({self.train_cutoff_ts}): cutoffs must increase"
                )
        else:
            raise ValueError(f"split.kind must be 'leave_one_out' or 'time', got {self.kind!r}")


@dataclass(kw_only=True)
class PrepareConfig:
    """Settings of `prepare` (the CLI passes them through as keyword arguments)."""

    split: SplitConfig = field(default_factory=SplitConfig)
    """Train / valid / test split."""
    memory_budget_mb: int = 1024
    """Target peak RSS of the whole run (>= 256); sets the number of spill buckets."""
    num_shards: int = 4
    """Parquet files per split (readers shard by row group, so this is not a rank count)."""
    row_group_users: int = 1024
    """Users per output row group: the loader's unit of work and of shuffling."""


def prepare(
    log_paths_or_glob: str | os.PathLike | list[str | os.PathLike],
    out_dir: str | os.PathLike,
    features: FeatureSpec,
    split: SplitConfig,
    *,
    memory_budget_mb: int = PrepareConfig.memory_budget_mb,
    num_shards: int = PrepareConfig.num_shards,
    row_group_users: int = PrepareConfig.row_group_users,
    num_buckets: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Prepare event logs into split sequence shards under `out_dir`; returns the manifest.

    `log_paths_or_glob`: a file, a directory (its *.parquet), a glob, or a list of those.
    Bad input raises ValueError naming the file (and column / row group) before anything
    is written to `out_dir`; the output appears atomically (temp dir + rename) or not at all.
    `num_buckets` overrides the spill bucket count derived from `memory_budget_mb`.
    """
    check_settings(features, split, memory_budget_mb=memory_budget_mb, num_shards=num_shards,
                   row_group_users=row_group_users)
    out_dir = claim_output_dir(out_dir, overwrite=overwrite, manifest=MANIFEST, format=FORMAT_VERSION)

    paths = resolve_paths(log_paths_or_glob)
    logs = [open_log(p, features) for p in paths]
    check_consistent_types(logs)
    total_rows = sum(log.num_rows for log in logs)

    columns = _spill_columns(features)
    rec_dtype = _record_dtype(features)
    bytes_per_row = _PASS2_COPIES * rec_dtype.itemsize + 16
    # What the sort pass may hold: the budget less a fixed reserve for the interpreter,
    # numpy / arrow / torch-free imports (~120 MB), arrow pools and the item counts.
    budget = max(memory_budget_mb - _RESERVED_MB, memory_budget_mb // 4) * (1 << 20)
    if num_buckets is None:
        num_buckets = int(min(_MAX_BUCKETS, max(num_shards, -(-total_rows * bytes_per_row // budget))))
        _check_open_files(num_buckets, f"data.prepare.memory_budget_mb={memory_budget_mb} ({num_buckets} spill "
                                       f"buckets for {total_rows:,} events)", "raise the budget")
    elif not 1 <= num_buckets <= _MAX_BUCKETS:
        raise ValueError(f"num_buckets must be in [1, {_MAX_BUCKETS}], got {num_buckets}")
    else:
        _check_open_files(num_buckets, f"num_buckets={num_buckets} (one spill file each)", "lower it")

    tmp_dir = staging_dir(out_dir)
    try:
        spill_dir = tmp_dir / "_spill"
        spill_dir.mkdir()
        _pass1_spill(logs, features, columns, rec_dtype, spill_dir, num_buckets, total_rows, progress)
        counts = _pass2_build(
            spill_dir, features, split, rec_dtype, tmp_dir, num_buckets, num_shards, row_group_users, progress
        )
        _check_not_empty(counts, split)
        shutil.rmtree(spill_dir)
        manifest = {
            "format": FORMAT_VERSION,
            "features": asdict(features),
            "split": asdict(split),
            "schema": _output_columns(features),
            "counts": counts,
            "settings": {
                "memory_budget_mb": memory_budget_mb,
                "num_shards": num_shards,
                "num_buckets": num_buckets,
                "row_group_users": row_group_users,
            },
            "sources": [
                {"path": str(log.path.resolve()), "size": log.path.stat().st_size, "rows": log.num_rows,
                 "sha256": sha256_file(log.path)}
                for log in logs
            ],
            "outputs": {
                str(p.relative_to(tmp_dir)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(tmp_dir.rglob("*.parquet"))
            },
        }
        atomic_write_text(tmp_dir / MANIFEST, json.dumps(manifest, indent=2))
        publish_dir(tmp_dir, out_dir, manifest=MANIFEST, format=FORMAT_VERSION)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return manifest


def load_manifest(prepared_dir: str | os.PathLike) -> dict:
    """The manifest of a prepared directory; ValueError when it is not one."""
    path = Path(prepared_dir) / MANIFEST
    if not path.is_file():
        raise ValueError(f"{prepared_dir}: no manifest.json (not a prepared directory)")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT_VERSION!r}")
    return manifest


def prepare_converted(
    source: str,
    inputs: list[str | os.PathLike],
    out_dir: str | os.PathLike,
    features: FeatureSpec,
    split: SplitConfig,
    *,
    memory_budget_mb: int = PrepareConfig.memory_budget_mb,
    num_shards: int = PrepareConfig.num_shards,
    row_group_users: int = PrepareConfig.row_group_users,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """`convert` `inputs` of format `source` into `<out_dir>.logs` (beside `out_dir`), then
    `prepare` that log into `out_dir`; returns the manifest.

    The settings and `out_dir` are checked before converting. If `prepare` then fails, the
    `.logs` folder this call made is removed, so that the corrected command is not refused
    over it; one that held a log before the call is left to its owner. A `.logs` folder that
    holds the conversion of the same `source` and `inputs` (left by a run killed before it
    could clean up) is converted again in place, without `overwrite`.
    """
    from genrec.data.convert import MANIFEST_NAME, convert

    settings = dict(memory_budget_mb=memory_budget_mb, num_shards=num_shards, row_group_users=row_group_users)
    check_settings(features, split, **settings)
    out = claim_output_dir(out_dir, overwrite=overwrite, manifest=MANIFEST, format=FORMAT_VERSION)
    logs = out.with_name(out.name + ".logs")
    made_logs = not logs.exists() or (logs.is_dir() and not any(logs.iterdir()))
    # A run killed after converting leaves its log, and then the same command was refused
    # over it until given --overwrite. Converting the same inputs again gives the same log.
    again = not made_logs and _same_conversion(logs / MANIFEST_NAME, source, inputs)
    convert(source, inputs, logs, overwrite=overwrite or again, progress=progress)
    try:
        return prepare(logs, out, features, split, overwrite=overwrite, progress=progress, **settings)
    except BaseException:
        if made_logs:
            shutil.rmtree(logs, ignore_errors=True)
        raise


def _same_conversion(manifest_path: Path, source: str, inputs: list[str | os.PathLike]) -> bool:
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(manifest, dict) and manifest.get("kind") == "genrec-convert"
            and manifest.get("source") == source
            and manifest.get("inputs") == [str(Path(p).resolve()) for p in inputs])


# ----------------------------------------------------------------------------------------
# Settings checks (nothing is read or written before these pass)


def check_settings(features: FeatureSpec, split: SplitConfig, *, memory_budget_mb: int, num_shards: int,
                   row_group_users: int) -> None:
    """ValueError naming the setting for anything wrong in `prepare`'s settings that shows
    without reading a log."""
    split.validate()
    _validate_features(features)
    if memory_budget_mb < 256:
        raise ValueError(f"data.prepare.memory_budget_mb must be >= 256, got {memory_budget_mb}")
    if num_shards < 1:
        raise ValueError(f"data.prepare.num_shards must be >= 1, got {num_shards}")
    if not 1 <= row_group_users <= _MAX_ROW_GROUP_USERS:
        raise ValueError(f"data.prepare.row_group_users must be in [1, {_MAX_ROW_GROUP_USERS}], got {row_group_users}")
    _check_open_files(len(SPLITS) * num_shards, f"data.prepare.num_shards={num_shards} (one output file per "
                      "split and shard)", "lower it")


def _check_open_files(num_files: int, what: str, remedy: str) -> None:
    # Pass 1 keeps every spill file open, pass 2 every split's writers: running out midway
    # fails deep inside pyarrow, and with no descriptor left even the cleanup fails.
    limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if limit != resource.RLIM_INFINITY and num_files + _SPARE_FILES > limit:
        raise ValueError(f"{what} keeps {num_files} files open at once, more than the open-file limit of {limit} "
                         f"(ulimit -n) allows with {_SPARE_FILES} to spare: {remedy} or raise the limit")


def _check_not_empty(counts: dict, split: SplitConfig) -> None:
    # Evaluation rows need a training history, so an empty train/ means every split is.
    if counts["rows"]["train"]:
        return
    if counts["users_dropped_min_events"] == counts["users"]:
        raise ValueError(f"data.prepare.split.min_user_events={split.min_user_events} drops all "
                         f"{counts['users']:,} users: the output would have no rows")
    raise ValueError(f"data.prepare.split.train_cutoff_ts={split.train_cutoff_ts} is at or before every event "
                     "of the users kept: the output would have no rows")


def _validate_features(features: FeatureSpec) -> None:
    if features.item not in features.sparse:
        raise ValueError(f"features.item {features.item!r} must be one of features.sparse {features.sparse}")
    names = [*features.sparse, *features.labels]
    if len(set(names)) != len(names):
        raise ValueError(f"features.sparse + features.labels repeat a column: {names}")
    for reserved in (USER_COLUMN, TS_COLUMN):
        if reserved in names:
            raise ValueError(f"features: {reserved!r} is reserved for the output's user key / timestamps")


# ----------------------------------------------------------------------------------------
# Pass 1: stream the logs into per-bucket spill files of fixed-width records


def _spill_columns(features: FeatureSpec) -> list[str]:
    return [features.user_key, features.timestamp, *features.sparse, *features.labels]


def _record_dtype(features: FeatureSpec) -> np.dtype:
    fields = [("u", np.int64), ("t", np.int64)]
    fields += [(f"s{i}", np.int64) for i in range(len(features.sparse))]
    fields += [(f"l{i}", np.int8) for i in range(len(features.labels))]
    return np.dtype(fields)



def _bucket_of(users: np.ndarray, num_buckets: int) -> np.ndarray:
    # Fibonacci hashing: sequential user ids spread evenly over the buckets.
    mixed = (users.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(33)
    return (mixed % np.uint64(num_buckets)).astype(np.int64)


def _pass1_spill(logs, features, columns, rec_dtype, spill_dir, num_buckets, total_rows, progress):
    roles = {**{s: "sparse feature" for s in features.sparse}, **{lab: "label" for lab in features.labels},
             features.user_key: "user key", features.timestamp: "timestamp", features.item: "item"}
    handles = [open(spill_dir / f"bucket-{b:05d}.bin", "wb") for b in range(num_buckets)]
    bar = tqdm(total=total_rows, unit="ev", desc="prepare: spill", file=sys.stderr, disable=not progress)
    try:
        for log in logs:
            row = 0  # of the file, 0-based: where this batch starts
            for rg, batches in row_groups(log, list(dict.fromkeys(columns)), _PASS1_BATCH_ROWS):
                for batch in batches:
                    rec = np.empty(batch.num_rows, dtype=rec_dtype)
                    for name, slot in zip(columns, rec_dtype.names):
                        arr = batch.column(name)
                        if pa.types.is_dictionary(arr.type):
                            arr = arr.dictionary_decode()
                        if arr.null_count:
                            # No null has a meaning: read as 0 it would be a real id, or a
                            # "not clicked" label, and change the data without a word.
                            first = row + int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
                            raise ValueError(
                                f"{log.path}: column {name!r} ({roles[name]}) has {arr.null_count} nulls in row "
                                f"group {rg}, the first in row {first} of the file (0-based): drop those rows or "
                                "give the missing values a value of their own"
                            )
                        if log.is_string[name]:
                            arr = hash_string_ids(arr)
                        elif pa.types.is_boolean(arr.type):
                            arr = arr.cast(pa.int8())
                        elif pa.types.is_uint64(arr.type):  # stored as int64: the top half would wrap negative
                            top = pc.max(arr).as_py()
                            if top is not None and top > np.iinfo(np.int64).max:
                                raise ValueError(f"{log.path}: column {name!r} has value {top} in row group {rg}, "
                                                 "above 2^63 - 1 (ids and times are kept as int64)")
                        values = arr.to_numpy(zero_copy_only=False)
                        low = values.min() if values.size and (slot == "u" or slot.startswith("s")) else 0
                        if low < 0:
                            # The sparse store keeps negative ids for itself (hashed string ids
                            # are never negative): refused here, not at some training batch.
                            raise ValueError(f"{log.path}: column {name!r} has negative id {low} in row group {rg} "
                                             "(ids must be >= 0)")
                        if slot.startswith("l"):
                            values = values.astype(np.int64)
                            if values.size and (values.min() < 0 or values.max() > 1):
                                raise ValueError(
                                    f"{log.path}: label column {name!r} has values outside 0/1 in row group {rg}"
                                )
                        rec[slot] = values
                    bucket = _bucket_of(rec["u"], num_buckets)
                    order = np.argsort(bucket, kind="stable")
                    rec = rec[order]
                    bounds = np.concatenate([[0], np.cumsum(np.bincount(bucket, minlength=num_buckets))])
                    for b in np.flatnonzero(np.diff(bounds)):
                        rec[bounds[b] : bounds[b + 1]].tofile(handles[b])
                    bar.update(batch.num_rows)
                    row += batch.num_rows
    finally:
        bar.close()
        for h in handles:
            h.close()


# ----------------------------------------------------------------------------------------
# Pass 2: per bucket, sort by (user, ts), cut each user's sequence into split prefixes


def _output_columns(features: FeatureSpec) -> dict[str, str]:
    cols = {USER_COLUMN: "int64"}
    cols.update({s: "list<int64>" for s in features.sparse})
    cols[TS_COLUMN] = "list<int64>"
    cols.update({lab: "list<int8>" for lab in features.labels})
    return cols


def _output_schema(features: FeatureSpec) -> pa.Schema:
    fields = [pa.field(USER_COLUMN, pa.int64(), nullable=False)]
    fields += [pa.field(s, pa.list_(pa.int64())) for s in features.sparse]
    fields += [pa.field(TS_COLUMN, pa.list_(pa.int64()))]
    fields += [pa.field(lab, pa.list_(pa.int8())) for lab in features.labels]
    return pa.schema(fields)


def _split_prefix_lengths(split: SplitConfig, ts: np.ndarray, starts: np.ndarray, n_u: np.ndarray,
                          counts: dict) -> dict[str, np.ndarray]:
    """Per user, the length of its row in each split (0: no row). Rows are prefixes of the
    user's time-ordered events."""
    keep = n_u >= split.min_user_events
    counts["users_dropped_min_events"] += int((~keep).sum())
    zero = np.zeros_like(n_u)
    if split.kind == "leave_one_out":
        full = keep & (n_u >= 3)
        counts["users_train_only"] += int((keep & ~full).sum())
        return {
            "train": np.where(full, n_u - 2, np.where(keep, n_u, 0)),
            "valid": np.where(full, n_u - 1, 0),
            "test": np.where(full, n_u, 0),
        }

    def before(cutoff: int) -> np.ndarray:
        return np.add.reduceat((ts < cutoff).astype(np.int64), starts)

    def eval_rows(history_n: np.ndarray, upper: int | None, name: str) -> np.ndarray:
        # The first event at or after the cutoff is the target: it exists when the user
        # has more events than history, and lies in the window when before `upper`.
        has_next = history_n < n_u
        target_ts = ts[np.minimum(starts + history_n, len(ts) - 1)]
        in_window = has_next & (target_ts < upper if upper is not None else True)
        counts["eval_users_without_history"][name] += int((keep & in_window & (history_n == 0)).sum())
        return np.where(keep & in_window & (history_n > 0), history_n + 1, 0)

    n_train = before(split.train_cutoff_ts)
    lengths = {"train": np.where(keep, n_train, 0)}
    if split.valid_cutoff_ts is None:
        lengths["valid"] = zero
        lengths["test"] = eval_rows(n_train, None, "test")
    else:
        lengths["valid"] = eval_rows(n_train, split.valid_cutoff_ts, "valid")
        lengths["test"] = eval_rows(before(split.valid_cutoff_ts), None, "test")
    return lengths


def _pass2_build(spill_dir, features, split, rec_dtype, out_dir, num_buckets, num_shards, row_group_users,
                 progress) -> dict:
    schema = _output_schema(features)
    item_slot = f"s{features.sparse.index(features.item)}"
    counts: dict = {
        "source_events": 0,
        "users": 0,
        "users_dropped_min_events": 0,
        "users_train_only": 0,
        "eval_users_without_history": {"valid": 0, "test": 0},
        "rows": {s: 0 for s in SPLITS},
        "events": {s: 0 for s in SPLITS},
    }
    writers = {}
    items = _ItemCounter()
    pool = ThreadPoolExecutor(max_workers=len(SPLITS))
    pending: list[Future] = []
    try:
        # Opened inside the try: the writers opened before a failing one are closed too.
        for s in SPLITS:
            (out_dir / s).mkdir()
            for shard in range(num_shards):
                # No dictionary pages: ids and timestamps are high-cardinality, and plain + zstd
                # writes ~2x faster and ~1.5x smaller than the dictionary + snappy default.
                writers[s, shard] = pq.ParquetWriter(out_dir / s / f"part-{shard:05d}.parquet", schema,
                                                     use_dictionary=False, compression="zstd")
        for b in tqdm(range(num_buckets), desc="prepare: sort", file=sys.stderr, disable=not progress):
            path = spill_dir / f"bucket-{b:05d}.bin"
            rec = np.fromfile(path, dtype=rec_dtype)
            path.unlink()
            if rec.size == 0:
                continue
            # lexsort is stable: equal (user, ts) keep log order.
            order = np.lexsort((rec["t"], rec["u"]))
            # Contiguous columns: the per-split masks below gather from each several times.
            rec = {name: rec[name][order] for name in rec_dtype.names}
            del order
            users = rec["u"]
            starts = np.flatnonzero(np.concatenate([[True], users[1:] != users[:-1]]))
            n_u = np.diff(np.append(starts, len(users)))
            pos_in_user = np.arange(len(users)) - np.repeat(starts, n_u)
            counts["source_events"] += len(users)
            counts["users"] += len(starts)
            lengths = _split_prefix_lengths(split, rec["t"], starts, n_u, counts)
            for s in SPLITS:
                has_row = lengths[s] > 0
                if not has_row.any():
                    continue
                event_mask = pos_in_user < np.repeat(lengths[s], n_u)
                row_lengths = lengths[s][has_row]
                offsets = pa.array(np.concatenate([[0], np.cumsum(row_lengths)]).astype(np.int32))
                arrays = [pa.array(users[starts[has_row]])]
                for i in range(len(features.sparse)):
                    arrays.append(pa.ListArray.from_arrays(offsets, rec[f"s{i}"][event_mask]))
                arrays.append(pa.ListArray.from_arrays(offsets, rec["t"][event_mask]))
                for i in range(len(features.labels)):
                    arrays.append(pa.ListArray.from_arrays(offsets, rec[f"l{i}"][event_mask]))
                table = pa.Table.from_arrays(arrays, schema=schema)
                # parquet encoding releases the GIL: the three splits encode in parallel.
                pending.append(pool.submit(writers[s, b % num_shards].write_table, table,
                                           row_group_size=row_group_users))
                counts["rows"][s] += int(has_row.sum())
                counts["events"][s] += int(row_lengths.sum())
                if s == "train":
                    items.add(rec[item_slot][event_mask])
            del rec, users, pos_in_user
            for future in pending:
                future.result()
            pending.clear()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)
        for w in writers.values():
            w.close()
    item_ids, item_counts = items.result()
    order = np.lexsort((item_ids, -item_counts))
    items_table = pa.table({"item_id": item_ids[order], "count": item_counts[order]})
    pq.write_table(items_table, out_dir / "items.parquet")
    counts["items"] = int(len(item_ids))
    return counts


class _ItemCounter:
    """Distinct item ids with counts, merged lazily so the cost stays ~linear."""

    def __init__(self):
        self.ids = np.empty(0, np.int64)
        self.counts = np.empty(0, np.int64)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.pending_size = 0

    def add(self, item_ids: np.ndarray) -> None:
        ids, cnt = np.unique(item_ids, return_counts=True)
        self.pending.append((ids, cnt.astype(np.int64)))
        self.pending_size += len(ids)
        if self.pending_size > max(len(self.ids), 1 << 20):
            self._merge()

    def _merge(self) -> None:
        ids = np.concatenate([self.ids, *(p[0] for p in self.pending)])
        cnt = np.concatenate([self.counts, *(p[1] for p in self.pending)])
        self.ids, inverse = np.unique(ids, return_inverse=True)
        self.counts = np.bincount(inverse, weights=cnt, minlength=len(self.ids)).astype(np.int64)
        self.pending, self.pending_size = [], 0

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        self._merge()
        return self.ids, self.counts
