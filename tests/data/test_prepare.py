"""prepare: split layouts against a plain-Python reference, out-of-core equivalence,
manifest, atomic output, and every bad-input error."""

from __future__ import annotations

import hashlib
import json
import os
import resource
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from genrec.data.config import FeatureSpec
from genrec.data.convert import convert
from genrec.data.prepare import SplitConfig, load_manifest, prepare, prepare_converted
from genrec.data.schema import hash_string_id

from seqdata_helpers import AD_FEATURES, random_log, write_log


def read_split(out: Path, split: str) -> dict[int, dict]:
    rows = ds.dataset(out / split).to_table().to_pylist()
    by_user = {r["user_id"]: r for r in rows}
    assert len(by_user) == len(rows), "a user appears twice in one split"
    return by_user


def reference_sequences(table: pa.Table) -> dict[int, list[dict]]:
    """user -> events sorted by ts (ties in row order), the specification of pass 1 + 2."""
    seqs = defaultdict(list)
    for row in table.to_pylist():
        seqs[row["user_id"]].append(row)
    return {u: sorted(ev, key=lambda r: r["ts"]) for u, ev in seqs.items()}


def assert_row(row: dict, events: list[dict], features: FeatureSpec) -> None:
    for col in [*features.sparse, "ts", *features.labels]:
        assert row[col] == [e[col] for e in events], col


def no_leftovers(parent: Path) -> bool:
    return not any(p.name.startswith(".") for p in parent.iterdir())


def test_leave_one_out_layout_matches_reference(tmp_path):
    table = random_log(120, 3000, seed=3)
    # A few short users: 1 and 2 events.
    short = pa.table({"user_id": [5, 6, 6], "ts": [10, 20, 30], "item_id": [1, 2, 3], "action": [0, 1, 0],
                      "advertiser_id": [0, 0, 0], "click": pa.array([0, 1, 0], pa.int8()),
                      "conversion": pa.array([0, 0, 0], pa.int8())})
    table = pa.concat_tables([table, short.cast(table.schema)])
    write_log(table, tmp_path / "log", num_files=3, row_group_size=700)
    out = tmp_path / "out"
    manifest = prepare(tmp_path / "log" / "*.parquet", out, AD_FEATURES, SplitConfig(), num_shards=2,
                       progress=False)
    ref = reference_sequences(table)
    train, valid, test = (read_split(out, s) for s in ("train", "valid", "test"))
    for user, events in ref.items():
        if len(events) < 3:
            assert_row(train[user], events, AD_FEATURES)
            assert user not in valid and user not in test
        else:
            assert_row(train[user], events[:-2], AD_FEATURES)
            assert_row(valid[user], events[:-1], AD_FEATURES)
            assert_row(test[user], events, AD_FEATURES)
    assert set(train) == set(ref)
    counts = manifest["counts"]
    assert counts["users"] == len(ref) and counts["source_events"] == table.num_rows
    assert counts["users_train_only"] == sum(len(e) < 3 for e in ref.values()) == 2
    assert counts["rows"] == {"train": len(train), "valid": len(valid), "test": len(test)}
    assert counts["events"]["test"] == sum(len(r["ts"]) for r in test.values())
    # items: every train event counted once.
    items = pq.read_table(out / "items.parquet").to_pylist()
    expected = Counter(i for r in train.values() for i in r["item_id"])
    assert {r["item_id"]: r["count"] for r in items} == dict(expected)
    assert [r["count"] for r in items] == sorted((r["count"] for r in items), reverse=True)
    assert counts["items"] == len(expected)
    # Output schema is what the manifest says.
    schema = pq.read_schema(out / "test" / "part-00000.parquet")
    assert schema.field("user_id").type == pa.int64()
    assert schema.field("item_id").type == pa.list_(pa.int64())
    assert schema.field("click").type == pa.list_(pa.int8())
    assert schema.names == ["user_id", *AD_FEATURES.sparse, "ts", *AD_FEATURES.labels]


def test_time_split_layout(tmp_path):
    #           user 1: history before T, target in valid window, target in test window
    #           user 2: nothing before T (no valid row: no history), one event in each window
    #           user 3: only train events
    rows = [(1, 100, 11), (1, 150, 12), (1, 210, 13), (1, 220, 14), (1, 300, 15), (1, 310, 16),
            (2, 230, 21), (2, 400, 22), (3, 50, 31), (3, 60, 32)]
    table = pa.table({"user_id": [r[0] for r in rows], "ts": [r[1] for r in rows],
                      "item_id": [r[2] for r in rows], "action": [1] * len(rows),
                      "click": pa.array([1] * len(rows), pa.int8())})
    pq.write_table(table, tmp_path / "log.parquet")
    features = FeatureSpec(sparse=["item_id", "action"], labels=["click"])
    split = SplitConfig(kind="time", train_cutoff_ts=200, valid_cutoff_ts=250)
    manifest = prepare(tmp_path / "log.parquet", tmp_path / "out", features, split, progress=False)
    train, valid, test = (read_split(tmp_path / "out", s) for s in ("train", "valid", "test"))
    assert {u: r["item_id"] for u, r in train.items()} == {1: [11, 12], 3: [31, 32]}
    assert {u: r["item_id"] for u, r in valid.items()} == {1: [11, 12, 13]}
    # test history = everything before V (including the valid window), target = first event >= V.
    assert {u: r["item_id"] for u, r in test.items()} == {1: [11, 12, 13, 14, 15], 2: [21, 22]}
    assert manifest["counts"]["eval_users_without_history"] == {"valid": 1, "test": 0}
    assert manifest["split"]["valid_cutoff_ts"] == 250

    # Without a valid cutoff: no valid rows; test target = first event >= T; user 2 has no history.
    split = SplitConfig(kind="time", train_cutoff_ts=200)
    manifest = prepare(tmp_path / "log.parquet", tmp_path / "out2", features, split, progress=False)
    assert read_split(tmp_path / "out2", "valid") == {}
    assert {u: r["item_id"] for u, r in read_split(tmp_path / "out2", "test").items()} == {1: [11, 12, 13]}
    assert manifest["counts"]["eval_users_without_history"]["test"] == 1


def test_string_ids_are_hashed_and_ints_pass_through(tmp_path):
    table = pa.table({"user_id": ["alice", "alice", "alice", "bob"], "ts": [3, 1, 2, 5],
                      "item_id": ["x", "y", "z", "x"], "action": [1, 2, 3, 4],
                      "click": pa.array([True, False, True, False])})
    pq.write_table(table, tmp_path / "log.parquet")
    features = FeatureSpec(sparse=["item_id", "action"], labels=["click"])
    prepare(tmp_path / "log.parquet", tmp_path / "out", features, SplitConfig(), progress=False)
    test = read_split(tmp_path / "out", "test")
    row = test[hash_string_id("alice")]
    assert row["item_id"] == [hash_string_id(s) for s in ("y", "z", "x")]
    assert row["action"] == [2, 3, 1] and row["ts"] == [1, 2, 3] and row["click"] == [0, 1, 1]
    assert hash_string_id("bob") in read_split(tmp_path / "out", "train")


def test_dictionary_encoded_string_ids_are_read_as_their_strings(tmp_path):
    """A pandas categorical (an arrow dictionary of strings) holds string ids: it is hashed
    like the plain strings (it was refused as neither integer nor string ids)."""
    table = pa.table({"user_id": ["alice", "alice", "alice", "bob"], "ts": [3, 1, 2, 5],
                      "item_id": ["x", "y", "z", "x"], "action": [1, 2, 3, 4],
                      "click": pa.array([1, 0, 1, 0], pa.int8())})
    (tmp_path / "plain").mkdir()
    (tmp_path / "dict").mkdir()
    pq.write_table(table, tmp_path / "plain" / "a.parquet")
    encoded = table
    for name in ("user_id", "item_id"):
        i = encoded.schema.get_field_index(name)
        encoded = encoded.set_column(i, name, encoded.column(name).dictionary_encode())
    pq.write_table(encoded, tmp_path / "dict" / "a.parquet")
    assert pa.types.is_dictionary(pq.ParquetFile(tmp_path / "dict" / "a.parquet").schema_arrow.field("user_id").type)
    features = FeatureSpec(sparse=["item_id", "action"], labels=["click"])
    for name in ("plain", "dict"):
        prepare(tmp_path / name, tmp_path / f"{name}-out", features, SplitConfig(), progress=False)
    for split in ("train", "valid", "test"):
        assert read_split(tmp_path / "dict-out", split) == read_split(tmp_path / "plain-out", split)
    assert read_split(tmp_path / "dict-out", "test")[hash_string_id("alice")]["item_id"] == [
        hash_string_id(s) for s in ("y", "z", "x")]


def test_bucket_count_does_not_change_output(tmp_path):
    """The out-of-core path (many spill buckets) gives the same rows as a single bucket,
    and the same input gives byte-identical output."""
    write_log(random_log(200, 5000, seed=4), tmp_path / "log", num_files=2, row_group_size=333)
    outs = {}
    for n in (1, 37):
        prepare(tmp_path / "log", tmp_path / f"out{n}", AD_FEATURES, SplitConfig(), num_shards=3,
                num_buckets=n, progress=False)
        outs[n] = {s: read_split(tmp_path / f"out{n}", s) for s in ("train", "valid", "test")}
    assert outs[1] == outs[37]
    again = prepare(tmp_path / "log", tmp_path / "again", AD_FEATURES, SplitConfig(), num_shards=3,
                    num_buckets=37, progress=False)
    assert again["outputs"] == load_manifest(tmp_path / "out37")["outputs"]


def test_manifest_checksums_and_atomic_overwrite(tmp_path):
    paths = write_log(random_log(50, 800, seed=5), tmp_path / "log", num_files=2)
    out = tmp_path / "out"
    manifest = prepare(paths, out, AD_FEATURES, SplitConfig(), num_shards=2, progress=False)
    assert load_manifest(out) == json.loads((out / "manifest.json").read_text()) == manifest
    for src in manifest["sources"]:
        assert src["sha256"] == hashlib.sha256(Path(src["path"]).read_bytes()).hexdigest()
        assert src["size"] == Path(src["path"]).stat().st_size
    for rel, info in manifest["outputs"].items():
        assert info["sha256"] == hashlib.sha256((out / rel).read_bytes()).hexdigest()
    assert {"train/part-00000.parquet", "test/part-00001.parquet", "items.parquet"} <= set(manifest["outputs"])
    assert not (out / "_spill").exists()
    with pytest.raises(ValueError, match="exists"):
        prepare(paths, out, AD_FEATURES, SplitConfig(), progress=False)
    prepare(paths[:1], out, AD_FEATURES, SplitConfig(), num_shards=2, overwrite=True, progress=False)
    assert len(load_manifest(out)["sources"]) == 1
    assert no_leftovers(tmp_path)


def test_every_output_file_is_on_disk_before_the_folder_is_published(tmp_path, monkeypatch):
    """A rename can reach the disk before the data it names: every file and folder of the
    output is fsynced before the staging folder is renamed into place."""
    synced, renamed = [], []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def rename(src, dst):
        renamed.append((str(src), str(dst), len(synced)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    paths = write_log(random_log(50, 800, seed=5), tmp_path / "log", num_files=2)
    out = tmp_path / "out"
    prepare(paths, out, AD_FEATURES, SplitConfig(), num_shards=2, progress=False)
    src, dst, synced_before = next(r for r in renamed if r[1] == str(out))
    before = {Path(p).relative_to(src).as_posix() for p in synced[:synced_before] if p.startswith(src + "/")}
    published = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert published and published <= before, sorted(published - before)


def _good() -> pa.Table:
    return random_log(20, 200, seed=6)


def _with(table: pa.Table, name: str, array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, array)


def _null_at(table: pa.Table, name: str, row: int) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = None
    return _with(table, name, pa.array(values, table.schema.field(name).type))


def _uint64_with(table: pa.Table, name: str, row: int, value: int) -> pa.Array:
    values = table.column(name).to_pylist()
    values[row] = value
    return pa.array(values, pa.uint64())


def _value_at(table: pa.Table, name: str, row: int, value: int) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = value
    return _with(table, name, pa.array(values, table.schema.field(name).type))


BAD_TABLES = {
    "missing column": (lambda t: t.drop_columns(["advertiser_id"]), "missing column 'advertiser_id'"),
    "ts as string": (lambda t: _with(t, "ts", t.column("ts").cast(pa.string())), "'ts'.*type string"),
    "float item id": (lambda t: _with(t, "item_id", t.column("item_id").cast(pa.float64())), "'item_id'.*double"),
    "null user": (lambda t: _null_at(t, "user_id", 150), "'user_id'.*nulls in row group 1"),
    "null item": (lambda t: _null_at(t, "item_id", 3), "'item_id'.*nulls in row group 0"),
    "null ts": (lambda t: _null_at(t, "ts", 199), "'ts'.*nulls in row group 1"),
    # Nulls in a label or an optional id were read as 0: a "not clicked", or a real id 0.
    "null label": (lambda t: _null_at(t, "click", 150),
                   r"column 'click' \(label\) has 1 nulls in row group 1, the first in row 150 of the file"),
    "null sparse id": (lambda t: _null_at(t, "advertiser_id", 7),
                       r"column 'advertiser_id' \(sparse feature\) has 1 nulls in row group 0, the first in row 7"),
    "label out of 0/1": (lambda t: _with(t, "click", pa.array([2] * t.num_rows, pa.int8())), "'click'.*0/1"),
    "empty file": (lambda t: t.slice(0, 0), "empty file"),
    # uint64 above 2^63 - 1 used to wrap to a negative int64: the latest event sorted first.
    "uint64 ts past int64": (lambda t: _with(t, "ts", _uint64_with(t, "ts", 0, (1 << 63) + 10)),
                             "'ts'.*value 9223372036854775818 in row group 0"),
    "uint64 item past int64": (lambda t: _with(t, "item_id", _uint64_with(t, "item_id", 150, 1 << 63)),
                               "'item_id'.*in row group 1"),
    # The sparse store keeps negative ids for itself: training failed on them at some batch.
    "negative item id": (lambda t: _value_at(t, "item_id", 150, -7),
                         r"column 'item_id' has negative id -7 in row group 1 \(ids must be >= 0\)"),
    "negative sparse id": (lambda t: _value_at(t, "advertiser_id", 0, -(1 << 63)),
                           r"'advertiser_id' has negative id -9223372036854775808 in row group 0"),
    "negative user id": (lambda t: _value_at(t, "user_id", 199, -1), r"'user_id' has negative id -1 in row group 1"),
    # A repeated name has no field index: it was reported as a missing column.
    "repeated column": (lambda t: t.append_column("user_id", t.column("user_id")),
                        r"column 'user_id' \(user key\) appears 2 times"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_bad_table_raises_naming_file_and_writes_nothing(tmp_path, case):
    make_bad, pattern = BAD_TABLES[case]
    log = tmp_path / "log"
    write_log(_good(), log, num_files=1, row_group_size=100)
    bad = log / "bad.parquet"
    pq.write_table(make_bad(_good()), bad, row_group_size=100)
    out = tmp_path / "out" / "prepared"
    with pytest.raises(ValueError, match=pattern) as info:
        prepare(log, out, AD_FEATURES, SplitConfig(), progress=False)
    assert str(bad) in str(info.value)
    assert not out.exists() and (not out.parent.exists() or no_leftovers(out.parent))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "footer cut"])
def test_corrupt_parquet_raises(tmp_path, damage):
    log = tmp_path / "log"
    write_log(_good(), log, num_files=1)
    data = (log / "log-000.parquet").read_bytes()
    bad = log / "broken.parquet"
    bad.write_bytes({"garbage": b"not a parquet file at all", "truncated": data[: len(data) // 2],
                     "footer cut": data[:-3]}[damage])
    with pytest.raises(ValueError, match="broken.parquet.*(corrupt|truncated)"):
        prepare(log, tmp_path / "out", AD_FEATURES, SplitConfig(), progress=False)
    assert no_leftovers(tmp_path)


def test_corrupt_row_group_data_raises_naming_row_group(tmp_path):
    path = write_log(_good(), tmp_path / "log", num_files=1, row_group_size=100)[0]
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    # Overwrite the second row group's first data page (header and values) with junk.
    start = col.data_page_offset
    data[start : start + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="log-000.parquet: row group 1"):
        prepare(path, tmp_path / "out", AD_FEATURES, SplitConfig(), progress=False)
    assert no_leftovers(tmp_path)


def test_input_paths_and_types_across_files(tmp_path):
    with pytest.raises(ValueError, match="nothing.*matches no files"):
        prepare(tmp_path / "nothing*.parquet", tmp_path / "out", AD_FEATURES, SplitConfig(), progress=False)
    with pytest.raises(ValueError, match="no such file"):
        prepare(tmp_path / "absent.parquet", tmp_path / "out", AD_FEATURES, SplitConfig(), progress=False)
    for name in ("a", "b.parquet"):  # a Spark output is a folder named *.parquet
        (tmp_path / "dirs" / name).mkdir(parents=True)
    with pytest.raises(ValueError, match=r"dirs/\*: glob matches no files \(only directories\)"):
        prepare(tmp_path / "dirs" / "*", tmp_path / "out", AD_FEATURES, SplitConfig(), progress=False)
    log = tmp_path / "log"
    write_log(_good(), log)
    mixed = _good()
    pq.write_table(_with(mixed, "item_id", mixed.column("item_id").cast(pa.string())), log / "strings.parquet")
    with pytest.raises(ValueError, match="strings.parquet.*'item_id' holds string ids"):
        prepare(log, tmp_path / "out", AD_FEATURES, SplitConfig(), progress=False)
    assert no_leftovers(tmp_path)
    # One file under two spellings is read once (every event was counted twice).
    (log / "strings.parquet").unlink()
    part = sorted(log.glob("*.parquet"))[0]
    (log / "sub").mkdir()
    once = prepare([part], tmp_path / "once", AD_FEATURES, SplitConfig(), progress=False)
    twice = prepare([part, log / "sub" / ".." / part.name], tmp_path / "twice", AD_FEATURES, SplitConfig(),
                    progress=False)
    assert twice["counts"]["source_events"] == once["counts"]["source_events"]


@pytest.mark.parametrize(
    "split, pattern",
    [
        (SplitConfig(kind="time", train_cutoff_ts=200, valid_cutoff_ts=100), "valid_cutoff_ts.*after.*train_cutoff"),
        (SplitConfig(kind="time", train_cutoff_ts=200, valid_cutoff_ts=200), "cutoffs must increase"),
        (SplitConfig(kind="time"), "needs split.train_cutoff_ts"),
        (SplitConfig(train_cutoff_ts=5), "only apply to kind = 'time'"),
        (SplitConfig(min_user_events=0), "min_user_events"),
    ],
)
def test_bad_split_config(tmp_path, split, pattern):
    write_log(_good(), tmp_path / "log")
    with pytest.raises(ValueError, match=pattern):
        prepare(tmp_path / "log", tmp_path / "out", AD_FEATURES, split, progress=False)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_min_user_events_drops_and_counts(tmp_path):
    table = random_log(40, 400, seed=7)
    write_log(table, tmp_path / "log")
    manifest = prepare(tmp_path / "log", tmp_path / "out", AD_FEATURES, SplitConfig(min_user_events=12),
                       progress=False)
    lengths = Counter(table.column("user_id").to_pylist())
    dropped = sum(n < 12 for n in lengths.values())
    assert dropped > 0 and manifest["counts"]["users_dropped_min_events"] == dropped
    assert set(read_split(tmp_path / "out", "train")) == {u for u, n in lengths.items() if n >= 12}


@pytest.mark.parametrize(
    "split, pattern",
    [
        (SplitConfig(min_user_events=10**20), r"data.prepare.split.min_user_events=10{20} drops all 20 users"),
        (SplitConfig(kind="time", train_cutoff_ts=1_000_000), "data.prepare.split.train_cutoff_ts=1000000 is at or before"),
    ],
)
def test_a_split_that_leaves_no_rows_publishes_nothing(tmp_path, split, pattern):
    write_log(_good(), tmp_path / "log")
    with pytest.raises(ValueError, match=pattern):
        prepare(tmp_path / "log", tmp_path / "out", AD_FEATURES, split, progress=False)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


@pytest.fixture
def open_file_limit_1024():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    "settings, pattern",
    [
        (dict(num_shards=400), r"data.prepare.num_shards=400 .* keeps 1200 files open at once.* limit of 1024"),
        (dict(num_buckets=4000), r"num_buckets=4000 .* keeps 4000 files open at once"),
        (dict(row_group_users=10**20), r"data.prepare.row_group_users must be in \[1, 2147483648\]"),
        (dict(row_group_users=0), r"data.prepare.row_group_users must be in"),
        (dict(num_shards=0), r"data.prepare.num_shards must be >= 1"),
        (dict(memory_budget_mb=100), r"data.prepare.memory_budget_mb must be >= 256"),
    ],
)
def test_bad_settings_name_the_key_before_any_work(tmp_path, open_file_limit_1024, settings, pattern):
    """Too many shards ran out of descriptors midway (a traceback, and a staging folder the
    cleanup could not remove); a huge row_group_users overflowed inside pyarrow."""
    write_log(_good(), tmp_path / "log")
    with pytest.raises(ValueError, match=pattern):
        prepare(tmp_path / "log", tmp_path / "out", AD_FEATURES, SplitConfig(), progress=False, **settings)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_writers_opened_before_a_failing_one_are_closed(tmp_path, monkeypatch):
    opened, closed = [], []
    real = pq.ParquetWriter

    class Writer(real):
        def __init__(self, *args, **kwargs):
            if len(opened) == 4:
                raise OSError(24, "Too many open files")
            super().__init__(*args, **kwargs)
            opened.append(self)

        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(pq, "ParquetWriter", Writer)
    write_log(_good(), tmp_path / "log")
    with pytest.raises(OSError, match="Too many open files"):
        prepare(tmp_path / "log", tmp_path / "out", AD_FEATURES, SplitConfig(), num_shards=2, progress=False)
    assert len(opened) == 4 and set(map(id, closed)) == set(map(id, opened))
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


ML_TEXT = "1\t10\t5\t100\n1\t11\t3\t200\n1\t12\t4\t300\n2\t10\t5\t100\n2\t13\t1\t150\n2\t14\t2\t160\n"
ML_FEATURES = FeatureSpec(sparse=["item_id", "action"], labels=[])


@pytest.mark.parametrize(
    "features, split, pattern, converted",
    [
        # Caught only by prepare, after the conversion: the log it made goes too.
        (FeatureSpec(), SplitConfig(), "missing column 'advertiser_id'", True),
        (ML_FEATURES, SplitConfig(min_user_events=10), "min_user_events=10 drops all 2 users", True),
        # Settings are checked before anything is converted.
        (ML_FEATURES, SplitConfig(kind="time"), "needs split.train_cutoff_ts", False),
        (FeatureSpec(sparse=["action"]), SplitConfig(), "features.item 'item_id' must be one of", False),
    ],
)
def test_a_failed_prepare_from_leaves_no_converted_log(tmp_path, features, split, pattern, converted, monkeypatch):
    """The `.logs` folder a failed run left behind made the corrected command fail too."""
    import genrec.data.convert

    calls, real = [], genrec.data.convert.convert

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(genrec.data.convert, "convert", counted)
    raw = tmp_path / "u.data"
    raw.write_text(ML_TEXT)
    with pytest.raises(ValueError, match=pattern):
        prepare_converted("movielens", [raw], tmp_path / "ml", features, split, progress=False)
    assert len(calls) == converted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u.data"]
    manifest = prepare_converted("movielens", [raw], tmp_path / "ml", ML_FEATURES, SplitConfig(), progress=False)
    assert manifest["counts"]["users"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ml", "ml.logs", "u.data"]


def test_a_failed_prepare_from_keeps_a_log_it_did_not_make(tmp_path):
    raw = tmp_path / "u.data"
    raw.write_text(ML_TEXT)
    convert("movielens", [raw], tmp_path / "ml.logs", progress=False)
    with pytest.raises(ValueError, match="missing column 'advertiser_id'"):
        prepare_converted("movielens", [raw], tmp_path / "ml", FeatureSpec(), SplitConfig(), overwrite=True,
                          progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ml.logs", "u.data"]
    assert (tmp_path / "ml.logs" / "convert_manifest.json").is_file()


def test_a_killed_prepare_from_is_rerun_by_the_same_command(tmp_path):
    """A run killed after converting (no cleanup) leaves `.logs` and no output: the same
    command was refused over that log until given --overwrite."""
    raw = tmp_path / "u.data"
    raw.write_text(ML_TEXT)
    convert("movielens", [raw], tmp_path / "ml.logs", progress=False)  # what the killed run left
    manifest = prepare_converted("movielens", [raw], tmp_path / "ml", ML_FEATURES, SplitConfig(), progress=False)
    assert manifest["counts"]["users"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ml", "ml.logs", "u.data"]
    # A log of other inputs, or with a file of the user's in it, is still refused.
    other = tmp_path / "other.data"
    other.write_text(ML_TEXT)
    convert("movielens", [other], tmp_path / "ml2.logs", progress=False)
    with pytest.raises(ValueError, match=r"ml2\.logs exists and is not empty"):
        prepare_converted("movielens", [raw], tmp_path / "ml2", ML_FEATURES, SplitConfig(), progress=False)
    convert("movielens", [raw], tmp_path / "ml3.logs", progress=False)
    (tmp_path / "ml3.logs" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files .* does not list \(notes\.txt\)"):
        prepare_converted("movielens", [raw], tmp_path / "ml3", ML_FEATURES, SplitConfig(), progress=False)
    assert (tmp_path / "ml3.logs" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("from_source", [False, True])
def test_out_dot_is_the_current_folder(tmp_path, monkeypatch, from_source):
    """`--out .` put the staging folder inside the output (refused as a stranger's), could
    not rename `.` aside with --overwrite, and gave `.logs` an empty name."""
    raw = tmp_path / "u.data"
    raw.write_text(ML_TEXT)
    log = tmp_path / "log"
    convert("movielens", [raw], log, progress=False)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for overwrite in (False, True):
        if from_source:
            prepare_converted("movielens", [raw], ".", ML_FEATURES, SplitConfig(), overwrite=overwrite,
                              progress=False)
        else:
            prepare(log, ".", ML_FEATURES, SplitConfig(), overwrite=overwrite, progress=False)
        assert load_manifest(here)["counts"]["users"] == 2
        os.chdir(here)  # the folder the process stood in was replaced
    names = ["here", "log", "u.data"] + (["here.logs"] if from_source else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_input_without_from_is_refused(tmp_path):
    from genrec.scripts import commands
    from genrec.scripts.cli import build_parser

    write_log(_good(), tmp_path / "log")
    raw = tmp_path / "u.data"
    raw.write_text(ML_TEXT)
    args = build_parser().parse_args(["prepare", "--logs", str(tmp_path / "log"), "--input", str(raw),
                                      "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="--input only applies with --from"):
        commands.prepare(args)
    assert not (tmp_path / "out").exists()
