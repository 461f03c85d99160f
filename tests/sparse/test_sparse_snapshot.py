"""Snapshots: exact continuation (also across a killed process), atomicity, corruption, export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection
from genrec.sparse import snapshot as snap
from genrec.sparse.snapshot import load_snapshot, save_snapshot


def make_config(ssd_dir=None) -> SparseConfig:
    return SparseConfig(
        tables=[
            TableConfig(name="item", embedding_dim=6, feature_names=["item_id"], device_rows=8, host_rows=8,
                        admit_min_count=2, ttl_seconds=50, learning_rate=0.05, seed=1),
            TableConfig(name="adv", embedding_dim=3, feature_names=["advertiser_id"], device_rows=2, host_rows=2,
                        optimizer="adam", cache_policy="lfu", learning_rate=0.01, seed=2),
        ],
        ssd_slab_rows=16,
        ssd_dir=ssd_dir,
    )


def batch(step: int) -> tuple[KeyedJaggedTensor, int]:
    g = torch.Generator().manual_seed(1000 + step)
    lens = torch.randint(0, 6, (4,), generator=g)
    n = int(lens.sum())
    items = torch.randint(0, 200, (n,), generator=g)
    advs = torch.randint(0, 30, (n,), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["item_id", "advertiser_id"], values=torch.cat([items, advs]),
                                              lengths=torch.cat([lens, lens]))
    return kjt, step * 7  # event time advances so TTL drops some rows


def run_steps(tec, start: int, stop: int) -> None:
    for step in range(start, stop):
        kjt, ts = batch(step)
        out = tec(kjt, event_time=ts)
        loss = sum(jt.values().sum() + jt.values().square().sum() for jt in out.values())
        loss.backward()


def full_state(tec):
    state = {}
    for name, store in tec.stores.items():
        ids, rows, meta = store.all_rows()
        order = torch.argsort(ids)
        p_ids, p_counts = store.pending.items()
        p_order = torch.argsort(p_ids)
        state[name] = (ids[order], rows[order], meta[order], p_ids[p_order], p_counts[p_order], store.step)
    return state


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name]):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), name
            else:
                assert x == y, name


def test_save_load_continue_equals_uninterrupted(tmp_path):
    a = TieredEmbeddingCollection(make_config())
    run_steps(a, 0, 12)
    a.save_snapshot(str(tmp_path / "snap"))
    run_steps(a, 12, 24)
    b = TieredEmbeddingCollection(make_config())
    run_steps(b, 0, 3)  # state to be replaced
    b.load_snapshot(str(tmp_path / "snap"))
    run_steps(b, 12, 24)
    assert_same_state(full_state(a), full_state(b))
    assert a.stores["item"].tiers[2].num_used > 0 and a.stores["item"].pending.num_live > 0


def test_killed_process_snapshot_continues_exactly(tmp_path):
    """A child trains, snapshots, and is SIGKILLed in the middle of a second snapshot."""
    snap_dir = tmp_path / "snap"
    child = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_sparse_snapshot import make_config, run_steps
        from genrec.sparse import TieredEmbeddingCollection
        from genrec.sparse import snapshot
        tec = TieredEmbeddingCollection(make_config())
        run_steps(tec, 0, 10)
        tec.save_snapshot({str(snap_dir)!r})
        run_steps(tec, 10, 15)
        real, n = snapshot._Writer.close, [0]
        def dying(self):
            n[0] += 1
            if n[0] == 7:  # every file closes once: this is among the second table's
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self)
        snapshot._Writer.close = dying
        tec.save_snapshot({str(snap_dir)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert len([p for p in os.listdir(snap_dir) if p.startswith("v")]) == 2  # the torn version is left behind
    resumed = TieredEmbeddingCollection(make_config())
    resumed.load_snapshot(str(snap_dir))
    run_steps(resumed, 10, 20)
    straight = TieredEmbeddingCollection(make_config())
    run_steps(straight, 0, 20)
    assert_same_state(full_state(straight), full_state(resumed))
    resumed.save_snapshot(str(snap_dir))  # the next save (a delta on the loaded one) cleans up the torn version
    links = {f"v{link['version']}" for link in snap._links(snap.read_manifest(str(snap_dir)))}
    assert {p for p in os.listdir(snap_dir) if p.startswith("v")} == links and len(links) == 2


def _saved(tmp_path):
    tec = TieredEmbeddingCollection(make_config())
    run_steps(tec, 0, 8)
    path = str(tmp_path / "snap")
    save_snapshot(tec, path)
    manifest = json.load(open(os.path.join(path, "MANIFEST.json")))
    vdir = os.path.join(path, f"v{manifest['version']}")
    return tec, path, vdir


def test_corrupt_and_truncated_files_are_refused_and_store_untouched(tmp_path):
    tec, path, vdir = _saved(tmp_path)
    other = TieredEmbeddingCollection(make_config())
    run_steps(other, 0, 2)
    before = full_state(other)
    rows_file = os.path.join(vdir, "item.rank0.rows.bin")
    data = bytearray(open(rows_file, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(rows_file, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"item\.rank0\.rows\.bin is corrupt: CRC32"):
        other.load_snapshot(path)
    assert_same_state(before, full_state(other))
    meta_file = os.path.join(vdir, "adv.rank0.meta.bin")
    os.truncate(meta_file, os.path.getsize(meta_file) - 8)
    data[len(data) // 2] ^= 0x40
    open(rows_file, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"adv\.rank0\.meta\.bin is truncated"):
        other.load_snapshot(path)
    assert_same_state(before, full_state(other))
    with pytest.raises(ValueError, match="MANIFEST.json is missing"):
        other.load_snapshot(str(tmp_path / "elsewhere"))


def test_dimension_or_optimizer_mismatch_names_table(tmp_path):
    _, path, _ = _saved(tmp_path)
    cfg = make_config()
    cfg.tables[1].embedding_dim = 4
    with pytest.raises(ValueError, match=r"table 'adv' has embedding_dim 3, config says 4"):
        load_snapshot(TieredEmbeddingCollection(cfg), path)
    cfg = make_config()
    cfg.tables[0].optimizer = "sgd"
    with pytest.raises(ValueError, match=r"table 'item' was saved with optimizer 'rowwise_adagrad'"):
        load_snapshot(TieredEmbeddingCollection(cfg), path)


def test_snapshot_dir_uncreatable_names_path(tmp_path):
    tec = TieredEmbeddingCollection(make_config())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot create snapshot directory .*file"):
        snap.save_snapshot(tec, str(blocker / "snap"))


def test_a_save_removes_its_own_older_version_folders_and_nothing_else(tmp_path):
    tec = TieredEmbeddingCollection(make_config())
    run_steps(tec, 0, 4)
    path = tmp_path / "snap"
    for name, file in [("vocab", "words.txt"), ("venv", "pyvenv.cfg"), ("v1a2b", "notes.txt")]:
        (path / name).mkdir(parents=True)
        (path / name / file).write_text("mine")
    tec.save_snapshot(str(path))
    first = snap.read_manifest(str(path))["version"]
    run_steps(tec, 4, 8)
    tec.save_snapshot(str(path), full=True)  # the first save's version folder goes
    second = snap.read_manifest(str(path))["version"]
    assert sorted(p.name for p in path.iterdir()) == sorted(["MANIFEST.json", "v1a2b", "vocab", "venv", f"v{second}"])
    assert first != second and all((path / n / f).read_text() == "mine" for n, f in
                                    [("vocab", "words.txt"), ("venv", "pyvenv.cfg"), ("v1a2b", "notes.txt")])


def test_commit_is_durable_before_the_manifest_rename(tmp_path, monkeypatch):
    """Every shard file, the version folder and the folder holding it are fsynced before
    MANIFEST.json is renamed into place (else a crash can publish a manifest whose files
    or version folder are not on disk)."""
    tec = TieredEmbeddingCollection(make_config())
    run_steps(tec, 0, 6)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = os.path.realpath(tmp_path / "snap")
    written = tec.save_snapshot(path)
    monkeypatch.undo()
    manifest = json.load(open(os.path.join(path, "MANIFEST.json")))
    vdir = os.path.join(path, f"v{manifest['version']}")
    commit = events.index(("replace", os.path.join(path, "MANIFEST.json.tmp"), os.path.join(path, "MANIFEST.json")))
    before = events[:commit]
    shard_files = [os.path.realpath(p) for p in written if os.path.dirname(os.path.realpath(p)) == vdir]
    assert sorted(shard_files) == sorted(os.path.join(vdir, f) for f in os.listdir(vdir))
    for f in shard_files:
        renamed = before.index(("replace", f + ".tmp", f))
        assert ("fsync", f + ".tmp") in before[:renamed], f"{f} not fsynced before it was renamed"
    last_rename = max(before.index(("replace", f + ".tmp", f)) for f in shard_files)
    assert ("fsync", vdir) in before[last_rename:], "version folder not fsynced after its files were renamed"
    assert ("fsync", path) in before, "the snapshot folder (entry of the version folder) not fsynced"
    assert ("fsync", os.path.dirname(path)) in before, "a snapshot folder created by the save: parent not fsynced"


def test_manifest_checksum_and_row_counts_are_verified(tmp_path):
    tec, path, _ = _saved(tmp_path)
    other = TieredEmbeddingCollection(make_config())
    run_steps(other, 0, 2)
    before = full_state(other)
    mpath = os.path.join(path, "MANIFEST.json")
    good = open(mpath).read()
    edited = json.loads(good)
    edited["event_time"] += 1  # still valid JSON: only the manifest's own checksum can tell
    open(mpath, "w").write(json.dumps(edited))
    with pytest.raises(ValueError, match=r"MANIFEST\.json.*checksum"):
        other.load_snapshot(path)
    assert_same_state(before, full_state(other))
    # A row count that disagrees with the shard files, under a valid checksum.
    edited = json.loads(good)
    edited["tables"]["item"]["shards"][0]["num_rows"] += 1
    edited["manifest_crc32"] = snap.manifest_checksum(edited)
    open(mpath, "w").write(json.dumps(edited))
    with pytest.raises(ValueError, match=r"item\.rank0\.ids\.bin.*num_rows"):
        other.load_snapshot(path)
    assert_same_state(before, full_state(other))
    open(mpath, "w").write(good)
    other.load_snapshot(path)
    assert_same_state(full_state(tec), full_state(other))


def _slab_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith(".slab"))


def test_io_error_during_load_leaves_store_unchanged(tmp_path, monkeypatch):
    """An error after some rows were read (here: the SSD tier cannot grow while the second
    table loads) must leave every table as it was, and no staged slab behind."""
    from genrec.sparse import tiers

    tec, path, _ = _saved(tmp_path)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = make_config(ssd_dir=str(ssd))
    cfg.ssd_slab_rows = 4
    other = TieredEmbeddingCollection(cfg)
    run_steps(other, 0, 2)
    before, slabs_before = full_state(other), _slab_files(ssd)
    real = tiers._SlabArray.add_slab

    def no_space_for_adv(self):
        if self.path_prefix is not None and "adv" in self.path_prefix:
            raise OSError(28, "No space left on device", self.path_prefix)
        return real(self)

    monkeypatch.setattr(tiers._SlabArray, "add_slab", no_space_for_adv)
    with pytest.raises(OSError, match="No space left"):
        other.load_snapshot(path)
    monkeypatch.undo()
    assert_same_state(before, full_state(other))
    assert _slab_files(ssd) == slabs_before
    other.load_snapshot(path)
    assert_same_state(full_state(tec), full_state(other))


def _incremental(max_deltas: int) -> SparseConfig:
    cfg = make_config()
    cfg.snapshot_max_deltas = max_deltas
    return cfg


def test_incremental_chain_restores_what_full_snapshots_hold(tmp_path):
    """Each snapshot of a chain (full, then deltas into fresh folders, as checkpoints
    take them) loads to exactly the state a full snapshot of that moment holds: rows,
    optimizer state, metadata, admission counters (TTL drops and LFU evictions between
    snapshots included). A delta writes only the rows looked up since the one before;
    after max_deltas the next one is full; deleting the older folders breaks none."""
    live = TieredEmbeddingCollection(_incremental(max_deltas=2))
    kinds, states = [], []
    for k in range(5):
        run_steps(live, 6 * k, 6 * k + 6)
        live.save_snapshot(str(tmp_path / f"inc{k}"))
        live_before = live.last_snapshot
        live.save_snapshot(str(tmp_path / f"full{k}"), full=True)
        live.last_snapshot = live_before  # the chain goes on from the incremental one
        manifest = snap.read_manifest(str(tmp_path / f"inc{k}"))
        kinds.append(manifest["kind"])
        states.append(full_state(live))
        if manifest["kind"] == "delta":
            shards = manifest["tables"]["item"]["shards"][0]
            assert 0 < shards["num_rows"] < live.stores["item"].num_rows
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    assert any(snap.read_manifest(str(tmp_path / f"inc{k}"))["tables"]["item"]["shards"][0]["num_removed"]
               for k in (1, 2, 4))
    for k in range(4):  # the chains' older folders go, as pruned checkpoints do
        shutil.rmtree(tmp_path / f"inc{k}")
    restored = TieredEmbeddingCollection(make_config())
    restored.load_snapshot(str(tmp_path / "inc4"))
    assert_same_state(full_state(restored), states[4])
    full = TieredEmbeddingCollection(make_config())
    full.load_snapshot(str(tmp_path / "full4"))
    run_steps(restored, 30, 36)
    run_steps(full, 30, 36)
    assert_same_state(full_state(restored), full_state(full))


def test_every_link_of_a_chain_restores_its_moment(tmp_path):
    live = TieredEmbeddingCollection(_incremental(max_deltas=3))
    states = []
    for k in range(4):
        run_steps(live, 5 * k, 5 * k + 5)
        live.save_snapshot(str(tmp_path / f"s{k}"))
        states.append(full_state(live))
    for k in range(4):
        restored = TieredEmbeddingCollection(make_config())
        restored.load_snapshot(str(tmp_path / f"s{k}"))
        assert_same_state(full_state(restored), states[k])
    assert snap.read_manifest(str(tmp_path / "s3"))["kind"] == "delta"
    assert len(snap.read_manifest(str(tmp_path / "s3"))["chain"]) == 3
    # A removal log given up (it outgrew the table) makes the next snapshot full.
    live = TieredEmbeddingCollection(_incremental(max_deltas=3))
    run_steps(live, 0, 5)
    live.save_snapshot(str(tmp_path / "t0"))
    run_steps(live, 5, 10)
    live.stores["adv"].removed_since_snapshot = None
    live.save_snapshot(str(tmp_path / "t1"))
    assert snap.read_manifest(str(tmp_path / "t1"))["kind"] == "full"
