"""Snapshots: exact continuation (also across a killed process), atomicity, corruption, export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection
from genrec.sparse import snapshot as snap
from genrec.sparse.snapshot import export_quantized, load_snapshot, save_snapshot


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
            if n[0] == 7:  # every file closes once: this is the second table's second file
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
    resumed.save_snapshot(str(snap_dir))  # the next save cleans up the torn version
    assert len([p for p in os.listdir(snap_dir) if p.startswith("v")]) == 1


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


def test_export_quantized_rows(tmp_path):
    tec, _, _ = _saved(tmp_path)
    ids, rows, _ = tec.stores["item"].all_rows()
    exact = rows[torch.argsort(ids), :6]
    q8 = export_quantized(tec, "int8", str(tmp_path / "export"))
    qt = q8["item"]
    assert torch.equal(qt.ids_N, ids.sort().values)
    assert qt.rows_ND.dtype == torch.uint8
    err = (qt.dequantize() - exact).abs()
    assert (err <= qt.scale_bias_N2[:, :1] * 0.5 + 1e-7).all()
    manifest = json.load(open(tmp_path / "export" / "export.rank0.json"))
    assert manifest["tables"]["item"]["num_rows"] == ids.numel()
    raw = open(tmp_path / "export" / "item.rank0.rows.bin", "rb").read()
    assert raw == qt.rows_ND.numpy().tobytes()
    q16 = export_quantized(tec, "fp16")
    torch.testing.assert_close(q16["adv"].dequantize(), q16["adv"].rows_ND.float())
    assert (q16["item"].dequantize() - exact).abs().max() < 1e-3
    with pytest.raises(ValueError, match="'int4'"):
        export_quantized(tec, "int4")


def test_snapshot_dir_uncreatable_names_path(tmp_path):
    tec = TieredEmbeddingCollection(make_config())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot create snapshot directory .*file"):
        snap.save_snapshot(tec, str(blocker / "snap"))
