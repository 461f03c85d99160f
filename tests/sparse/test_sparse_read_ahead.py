"""Read-ahead of SSD-tier rows: advice that reads the disk early and changes nothing."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection


def _kjt(key: str, ids: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(keys=[key], values=torch.tensor(ids, dtype=torch.int64),
                                               lengths=torch.tensor([len(ids)]))


def _stream(steps: int, num_ids: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.arange(1, num_ids + 1, dtype=torch.float64).pow(-1.05)
    return [(_kjt("item", torch.multinomial(w, 64, replacement=True, generator=g).tolist()),
             _kjt("neg", torch.randint(0, 2 * num_ids, (16,), generator=g).tolist())) for _ in range(steps)]


def _rows(tec) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    ids, rows, meta = tec.stores["t"].all_rows()
    return {i: (r, m) for i, r, m in zip(ids.tolist(), rows, meta)}


def test_reading_ahead_changes_no_row_state_or_metadata():
    """A store told to read ahead (the next step's ids, and ids it will never look up, some
    absent) trains bit for bit like the reference store, which never reads ahead: same
    losses, rows, optimizer state and metadata, after the stream spilled rows to SSD."""
    table = TableConfig(name="t", embedding_dim=8, feature_names=["item", "neg"], seed=3, device_rows=8,
                        host_rows=24, max_rows=300)
    stream = _stream(40, num_ids=400)
    noise = torch.Generator().manual_seed(9)
    results, advised = {}, 0
    for kernels in ("native", "reference"):
        tec = TieredEmbeddingCollection(SparseConfig(tables=[table], ssd_slab_rows=16, kernels=kernels))
        losses = []
        for t, (hist, neg) in enumerate(stream):
            if kernels == "native":
                upcoming = [stream[t + 1][0], stream[t + 1][1]] if t + 1 < len(stream) else []
                other = _kjt("item", torch.randint(0, 10**6, (32,), generator=noise).tolist())
                advised += tec.read_ahead(upcoming + [other])
            out, out_neg = tec(hist, event_time=1000 + t)["item"].values(), tec(neg)["neg"].values()
            loss = out.sum() + out.square().sum() * 0.5 - (out_neg * 0.3).square().sum()
            loss.backward()
            losses.append(loss.item())
        results[kernels] = losses, _rows(tec), tec.stores["t"]
    (loss_n, rows_n, store_n), (loss_r, rows_r, _) = results["native"], results["reference"]
    assert advised > 0 and store_n.tiers[2].num_used > 0, "the stream must put rows on the SSD tier and advise them"
    assert loss_n == loss_r
    assert sorted(rows_n) == sorted(rows_r)
    for i in rows_r:
        assert torch.equal(rows_n[i][0], rows_r[i][0]) and torch.equal(rows_n[i][1], rows_r[i][1]), f"row {i}"


def test_index_candidates_are_the_confirmed_locations():
    """The unconfirmed probe read-ahead uses finds each present id where the confirmed one
    does, and (22-bit fingerprints) almost never names a row for an absent id."""
    table = TableConfig(name="t", embedding_dim=4, feature_names=["item"], device_rows=64, host_rows=512)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[table], ssd_slab_rows=256))
    store = tec.stores["t"]
    ids = torch.randperm(10**7, generator=torch.Generator().manual_seed(1))[:5000]
    store.lookup_train(ids, torch.ones_like(ids), None)
    assert store.tiers[2].num_used > 0
    assert torch.equal(store.index.candidates(ids), store.index.get(ids, store._tier_view()))
    absent = torch.arange(10**8, 10**8 + 20_000)
    assert int((store.index.candidates(absent) >= 0).sum()) <= 2


def _read_bytes() -> int:
    return int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["read_bytes"])


def _settled_read_bytes(start: int, timeout: float = 10.0) -> int:
    """read_bytes once the reads in flight have been counted (it stops growing)."""
    last, t0 = _read_bytes(), time.monotonic()
    while time.monotonic() - t0 < timeout:
        time.sleep(0.05)
        now = _read_bytes()
        if now == last:
            break
        last = now
    return last - start


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_read_ahead_reads_the_disk_so_the_lookup_does_not(tmp_path):
    """With the SSD tier evicted from the page cache, read_ahead makes the disk read the
    pages of the coming lookup's SSD rows (the process's read_bytes grow by at least a page
    per row), and the lookup then reads next to nothing itself."""
    table = TableConfig(name="t", embedding_dim=64, feature_names=["item"], device_rows=256, host_rows=2048)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[table], ssd_dir=str(tmp_path), ssd_slab_rows=1 << 12))
    store = tec.stores["t"]
    all_ids = torch.arange(40_000)
    for chunk in all_ids.split(8192):
        store.lookup_train(chunk, torch.ones_like(chunk), None)
    ids = torch.randperm(40_000, generator=torch.Generator().manual_seed(2))[:600]
    ssd_rows = int((store.index.get(ids, store._tier_view()) & 3 == 2).sum())
    assert ssd_rows > 400
    store.tiers[2].drop_page_cache()
    before = _read_bytes()
    assert tec.read_ahead([_kjt("item", ids.tolist())]) >= ssd_rows  # on the adviser thread
    store.tiers[2].wait_advice()
    ahead = _settled_read_bytes(before)
    assert ahead >= ssd_rows * 4096, "read_ahead did not read the rows' pages from the disk"
    before = _read_bytes()
    store.lookup_train(ids, torch.ones_like(ids), None)
    assert _read_bytes() - before <= ahead // 10, "the lookup still read from the disk"


def test_a_lookup_the_read_ahead_advised_does_not_advise_its_pages_again(tmp_path):
    """The trainer reads batch t + 1 ahead before step t. Step t's lookup then skips its own
    advice (a syscall per page) for the ids read ahead, and still advises ids nobody read
    ahead; the rows it returns are the same either way."""
    table = TableConfig(name="t", embedding_dim=16, feature_names=["item"], device_rows=64, host_rows=512)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[table], ssd_dir=str(tmp_path), ssd_slab_rows=1 << 10))
    store = tec.stores["t"]
    for chunk in torch.arange(8000).split(2048):
        store.lookup_train(chunk, torch.ones_like(chunk), None)
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, 8000, (300,), generator=g).tolist() for _ in range(3))
    assert all(int((store.index.get(torch.tensor(x), store._tier_view()) & 3 == 2).sum()) > 100 for x in (a, b, c))
    tier, calls = store.tiers[2], []
    will_need = tier.will_need
    tier.will_need = lambda slots, background=False: calls.append(background) or will_need(slots, background)

    def step(ids):
        out = tec(_kjt("item", ids))["item"].values()
        out.sum().backward()
        return out.detach()

    tec.read_ahead([_kjt("item", a)])  # before the step before a's
    tec.read_ahead([_kjt("item", b)])  # before a's step
    rows_a = step(a)
    assert calls == [True, True], "the lookup of the ids read ahead advised them again"
    step(c)
    assert calls == [True, True, False], "a lookup of ids nobody read ahead must advise them itself"
    tier.wait_advice()
    (tmp_path / "ref").mkdir()
    reference = TieredEmbeddingCollection(SparseConfig(tables=[table], ssd_dir=str(tmp_path / "ref"),
                                                       ssd_slab_rows=1 << 10))
    for chunk in torch.arange(8000).split(2048):
        reference.stores["t"].lookup_train(chunk, torch.ones_like(chunk), None)
    out = reference(_kjt("item", a))["item"].values()
    assert torch.equal(out.detach(), rows_a)


def _advise_in_child(path: str, conn) -> None:
    from genrec.sparse.tiers import Tier

    tier = Tier("ssd", 8, None, torch.device("cpu"), path_prefix=path, slab_rows=256)
    slots = tier.alloc(300)
    conn.send(tier.will_need(slots, background=True))
    tier.wait_advice()
    conn.send("done")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_background_advice_works_in_a_forked_child(tmp_path):
    """The adviser thread does not survive a fork; a child that reads ahead gets its own
    rather than queueing work for a thread it does not have (which would never run)."""
    import multiprocessing as mp

    from genrec.sparse.tiers import Tier

    parent = Tier("ssd", 8, None, torch.device("cpu"), path_prefix=str(tmp_path / "parent"), slab_rows=256)
    assert parent.will_need(parent.alloc(10), background=True) == 10  # the parent's adviser exists now
    parent.wait_advice()
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_advise_in_child, args=(str(tmp_path / "child"), there))
    child.start()
    try:
        assert here.poll(30) and here.recv() == 300
        assert here.poll(30) and here.recv() == "done", "the child's background advice never ran"
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
