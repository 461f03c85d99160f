"""The SSD tier's directory: exclusive use, leftovers of earlier runs, nothing leaked on kill -9."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap

import pytest

from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection
from test_sparse_store import kjt_of, train_step


def _config(ssd_dir) -> SparseConfig:
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], device_rows=2, host_rows=2)
    return SparseConfig(tables=[cfg], ssd_dir=ssd_dir, ssd_slab_rows=4)


def _spill(tec, num_ids: int = 20) -> None:
    for i in range(num_ids):
        train_step(tec, kjt_of({"f": [[i]]}))
    assert tec.stores["t"].tiers[2].num_used > 8, "test must fill several SSD slabs"


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_two_live_stores_cannot_share_an_ssd_dir(tmp_path):
    first = TieredEmbeddingCollection(_config(str(tmp_path)))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + r".*in use"):
        TieredEmbeddingCollection(_config(str(tmp_path)))
    _spill(first)  # the refused store touched nothing of the live one
    del first
    gc.collect()
    TieredEmbeddingCollection(_config(str(tmp_path)))  # the lock went with the store


def test_leftover_slabs_of_an_earlier_run_are_removed_and_nothing_else(tmp_path):
    old = TieredEmbeddingCollection(_config(str(tmp_path)))
    _spill(old)
    del old
    gc.collect()
    table_dir = tmp_path / "t.rank0"
    assert len([f for f in os.listdir(table_dir) if f.endswith(".slab")]) > 3
    foreign = [table_dir / "notes.txt", table_dir / "tier.rows.00007.slab.bak", tmp_path / "keep.slab"]
    for p in foreign:
        p.write_text("not the store's")
    TieredEmbeddingCollection(_config(str(tmp_path)))
    slabs = [f for f in _files(tmp_path) if f.endswith(".slab")]
    # The new store opens one slab per SSD array (rows, ids, meta); nothing of the old run.
    assert len(slabs) == 4 and all(".00000." in f for f in slabs if f != "keep.slab"), slabs
    assert all(p.read_text() == "not the store's" for p in foreign)


def test_temporary_ssd_dir_does_not_leak_after_kill_9(tmp_path):
    child = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_sparse_ssd_dir import _config, _spill
        from genrec.sparse import TieredEmbeddingCollection
        tec = TieredEmbeddingCollection(_config(None))
        _spill(tec)
        print(tec.ssd_root, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    root = proc.stdout.strip().splitlines()[-1]
    # The slabs of a store with no ssd_dir hold no disk once their owner is gone.
    leaked = [f for f in (_files(root) if os.path.isdir(root) else []) if f.endswith(".slab")]
    assert not leaked, leaked
    TieredEmbeddingCollection(_config(None))  # the next store clears what a dead one left
    assert not os.path.exists(root)


def test_a_full_disk_is_an_error_naming_the_directory_and_the_snapshot_survives(tmp_path, monkeypatch):
    """The SSD tier's slabs are allocated when created: no space is an OSError naming the
    directory (a sparse mapping would die of SIGBUS at its first write instead), the failed
    slab leaves no file, and the last snapshot still loads with the rows it had."""
    import errno

    import torch

    ssd, other = tmp_path / "ssd", tmp_path / "other"
    ssd.mkdir(), other.mkdir()
    tec = TieredEmbeddingCollection(_config(str(ssd)))
    for i in range(6):
        train_step(tec, kjt_of({"f": [[i]]}))
    snap = str(tmp_path / "snap")
    tec.save_snapshot(snap)
    before = tec.eval()(kjt_of({"f": [[0, 1, 2, 3, 4, 5]]}))["f"].values().clone()
    tec.train()
    files_before = _files(ssd)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match=re.escape(str(ssd)) + r".*No space left") as err:
        _spill(tec, 40)
    assert err.value.errno == errno.ENOSPC
    assert _files(ssd) == files_before  # the failed slab left no file behind
    monkeypatch.undo()

    fresh = TieredEmbeddingCollection(_config(str(other)))
    fresh.load_snapshot(snap)
    torch.testing.assert_close(fresh.eval()(kjt_of({"f": [[0, 1, 2, 3, 4, 5]]}))["f"].values(), before,
                               rtol=0, atol=0)


def _read_bytes() -> int:
    return int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["read_bytes"])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_evicted_ssd_tier_is_read_back_from_the_disk(tmp_path):
    """drop_page_cache writes the slabs out and evicts them: the next gather reads the
    disk (the process's read_bytes grow by at least the rows' pages) and gives the rows
    that were written, including ones changed just before the eviction."""
    import torch

    from genrec.sparse.tiers import Tier

    tier = Tier("ssd", 65, None, torch.device("cpu"), path_prefix=str(tmp_path / "tier"), slab_rows=1 << 12)
    slots = tier.alloc(3 << 12)  # three slabs of 4,096 rows (1 MB each)
    rows = torch.randn(slots.numel(), 65)
    tier.rows.scatter(slots, rows)
    tier.drop_page_cache()
    picked = slots[torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(0))[:512]]
    tier.rows.scatter(picked[:8], -rows[picked[:8]])  # dirty pages, then evicted
    rows[picked[:8]] = -rows[picked[:8]]
    tier.drop_page_cache()
    before = _read_bytes()
    torch.testing.assert_close(tier.rows.gather(picked), rows[picked], rtol=0, atol=0)
    touched_pages = len({int(s) * 65 * 4 // 4096 for s in picked})
    assert _read_bytes() - before >= touched_pages * 4096, "the gather was served from the page cache"
