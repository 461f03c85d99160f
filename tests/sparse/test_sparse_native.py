"""Native store kernels (csrc/store.c) against the PyTorch reference, bit for bit; the index's
invariants and memory; CLOCK victims; a missing library is an error."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection, native
from genrec.sparse.store import TableStore


def _kjt(keys: list[str], seqs: list[list[int]]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor([x for s in seqs for x in s], dtype=torch.int64),
        lengths=torch.tensor([len(s) for s in seqs], dtype=torch.int64))


def _batches(steps: int, seed: int, num_ids: int):
    """Per step: history ids (Zipf-like, so with duplicates) and negatives, plus an event time."""
    g = torch.Generator().manual_seed(seed)
    w = torch.arange(1, num_ids + 1, dtype=torch.float64).pow(-1.1)
    for step in range(steps):
        hist = torch.multinomial(w, 48, replacement=True, generator=g).tolist()
        neg = torch.randint(0, num_ids * 2, (16,), generator=g).tolist()
        yield _kjt(["item"], [hist[:20], hist[20:]]), _kjt(["neg"], [neg]), 1000 + 7 * step


def _train(tec, steps: int, seed: int, num_ids: int) -> list[float]:
    losses = []
    for hist, neg, ts in _batches(steps, seed, num_ids):
        out = tec(hist, event_time=ts)["item"].values()
        out_neg = tec(neg, event_time=ts)["neg"].values()
        loss = out.sum() + out.square().sum() * 0.5 - (out_neg * 0.3).square().sum()
        loss.backward()
        losses.append(loss.item())
    return losses


def _rows(tec) -> dict[int, torch.Tensor]:
    ids, rows, meta = tec.stores["t"].all_rows()
    return {i: (r, m) for i, r, m in zip(ids.tolist(), rows, meta)}


def _check_index(store) -> None:
    """Every row is indexed at its own slot, nothing else is, and absent ids are absent."""
    view = store._tier_view()
    assert len(store.index) == store.num_rows
    for t, tier in enumerate(store.tiers):
        slots, ids = tier.used_slots()
        assert torch.equal(store.index.get(ids, view), (slots << 2) | t)
    never = torch.arange(10**12, 10**12 + 500)
    assert bool((store.index.get(never, view) == -1).all())


TABLES = {
    "lru_max_rows_ttl_admission": dict(device_rows=8, host_rows=16, max_rows=60, ttl_seconds=40,
                                       admit_min_count=2, admit_probability=0.5),
    "lfu_weight_decay_max_rows": dict(device_rows=6, host_rows=10, cache_policy="lfu", weight_decay=0.01,
                                      max_rows=50),
    "sgd_unbounded": dict(device_rows=4, host_rows=4, optimizer="sgd", learning_rate=0.1),
    "adam_default_tiers": dict(optimizer="adam", ttl_seconds=30, dim=50),
    # Every id resident after the first steps: the fused lookup commits (the rest rarely do).
    "adagrad_resident": dict(),
    # The row-wise sum of squares at other widths: 50 pads to 64 (vector levels), 3 to 4.
    "adagrad_dim50_weight_decay": dict(dim=50, weight_decay=0.01, device_rows=8, host_rows=16),
    "adagrad_dim3": dict(dim=3, max_rows=60),
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_native_kernels_give_the_reference_rows_bit_for_bit(name):
    """Same stream through both kernel sets: the same losses, and the same rows, optimizer
    state and metadata for the same ids, after evictions, SSD spills, TTL drops, max_rows
    drops and admissions (placements in the caches may differ: CLOCK vs exact order)."""
    spec = dict(TABLES[name])
    dim = spec.pop("dim", 8)
    table = TableConfig(name="t", embedding_dim=dim, feature_names=["item", "neg"], seed=3, **spec)
    results = {}
    for kernels in ("native", "reference"):
        tec = TieredEmbeddingCollection(SparseConfig(tables=[table], ssd_slab_rows=8, kernels=kernels))
        losses = _train(tec, steps=40, seed=1, num_ids=150)
        results[kernels] = losses, _rows(tec), tec.stores["t"]
    (loss_n, rows_n, store_n), (loss_r, rows_r, store_r) = results["native"], results["reference"]
    assert loss_n == loss_r
    assert sorted(rows_n) == sorted(rows_r)
    for i in rows_r:
        assert torch.equal(rows_n[i][0], rows_r[i][0]), f"row {i} differs"
        assert torch.equal(rows_n[i][1], rows_r[i][1]), f"metadata of row {i} differs"
    assert store_n.misses == store_r.misses
    # Every lookup of a present row is a hit of some tier (the tiers may differ, see above).
    assert int(store_n.hits.sum()) == int(store_r.hits.sum()) > 0
    if "max_rows" in spec or "ttl_seconds" in spec:
        assert store_n.misses > store_n.num_rows, "the stream must drop rows (and bring some back)"
    if spec.get("host_rows", 1 << 20) < 150:
        assert store_n.tiers[2].num_used > 0, "the stream must spill to SSD"
    pn, pr = store_n.pending.items(), store_r.pending.items()
    assert sorted(zip(pn[0].tolist(), pn[1].tolist())) == sorted(zip(pr[0].tolist(), pr[1].tolist()))
    _check_index(store_n)


def test_the_one_call_backward_gives_the_reference_rows_bit_for_bit(monkeypatch):
    """Every id of the stream has a row before it starts, so both lookups of most steps
    commit and their backwards are one native call each (bwd_apply: sums, then steps,
    the second reading the rows the first stepped), against the reference's rows."""
    table = TableConfig(name="t", embedding_dim=8, feature_names=["item", "neg"], seed=3, weight_decay=0.01)
    results, fused = {}, []
    bwd_apply = native.bwd_apply
    monkeypatch.setattr(native, "bwd_apply", lambda *a: fused.append(1) or bwd_apply(*a))
    for kernels in ("native", "reference"):
        tec = TieredEmbeddingCollection(SparseConfig(tables=[table], kernels=kernels))
        tec(_kjt(["item"], [list(range(300))])).get("item").values().square().sum().backward()
        results[kernels] = _train(tec, steps=30, seed=4, num_ids=150), _rows(tec)
    (loss_n, rows_n), (loss_r, rows_r) = results["native"], results["reference"]
    assert len(fused) >= 40, f"the one-call backward ran {len(fused)} times in 30 steps"
    assert loss_n == loss_r and sorted(rows_n) == sorted(rows_r)
    for i in rows_r:
        assert torch.equal(rows_n[i][0], rows_r[i][0]) and torch.equal(rows_n[i][1], rows_r[i][1]), f"row {i}"


def test_native_one_rank_training_takes_the_fused_path(monkeypatch):
    """Once every row is resident, a training step is one native call each way and never
    the general lookup."""
    table = TableConfig(name="t", embedding_dim=4, feature_names=["item", "neg"], device_rows=0, host_rows=1000)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[table]))
    store = tec.stores["t"]
    _train(tec, steps=3, seed=0, num_ids=100)
    tec(_kjt(["item"], [list(range(200))])).get("item").values().sum().backward()  # every id has a row now

    def other_path(*args, **kwargs):
        raise AssertionError("a path other than the two fused native calls ran")

    store._lookup_moving = other_path
    monkeypatch.setattr(native, "grad_accumulate", other_path)  # the backward is one call: bwd_apply
    monkeypatch.setattr(native, "apply_rows", other_path)
    before = dict(_rows(tec))
    _train(tec, steps=3, seed=5, num_ids=100)
    assert any(not torch.equal(before[i][0], r) for i, (r, _) in _rows(tec).items())


def test_the_registered_operators_train_like_the_direct_calls(monkeypatch):
    """torch.ops.genrec_sparse.* (the dispatcher's way in) run the kernels that the
    store's hot path calls directly: the same stream through either gives the same bits."""
    table = TableConfig(name="t", embedding_dim=8, feature_names=["item", "neg"], device_rows=0, host_rows=1000,
                        seed=3)

    def run():  # rows created (the general lookup, two-call backward), then all resident (one call)
        tec = TieredEmbeddingCollection(SparseConfig(tables=[table]))
        tec(_kjt(["item"], [list(range(150))])).get("item").values().square().sum().backward()
        return _train(tec, steps=12, seed=2, num_ids=100), _rows(tec)

    (loss_d, rows_d), called = run(), []
    names = ("fwd_lookup", "grad_accumulate", "apply_rows", "bwd_apply")
    for name in names:
        op = getattr(torch.ops.genrec_sparse, name)
        monkeypatch.setattr(native, name, lambda *a, _op=op, _name=name: called.append(_name) or _op(*a))
    loss_o, rows_o = run()
    assert set(called) == set(names)
    assert loss_o == loss_d and sorted(rows_o) == sorted(rows_d)
    for i in rows_d:
        assert torch.equal(rows_o[i][0], rows_d[i][0]) and torch.equal(rows_o[i][1], rows_d[i][1])


def test_native_index_stays_exact_and_small_as_it_grows():
    table = TableConfig(name="t", embedding_dim=2, feature_names=["item"], device_rows=0, host_rows=1 << 18)
    store = TieredEmbeddingCollection(SparseConfig(tables=[table])).stores["t"]
    for start in range(0, 200_000, 20_000):
        ids = torch.arange(start, start + 20_000) * 7919  # spread over the id space
        store.lookup_train(ids, torch.ones_like(ids), None)
    _check_index(store)
    per_row = store.index.nbytes / len(store.index)
    assert per_row <= 16, f"{per_row:.1f} bytes per row"
    # A growth holds one segment twice, never the whole index.
    assert store.index.peak_nbytes() <= store.index.nbytes * 1.05
    # Removing rows keeps every other row findable (tombstones keep the probe chains).
    gone = torch.arange(0, 200_000, 3) * 7919
    tier, slot = store._locate(gone)
    store._remove(gone, tier, slot)
    _check_index(store)
    assert bool((store._locate(gone)[1] == -1).all())
    # Churn: rows leave and new ones arrive, many times over; tombstones are cleared by
    # segment rebuilds, so the index stays exact and small.
    for round_ in range(6):
        old = torch.arange(round_ * 20_000, (round_ + 1) * 20_000) * 7919 + 1
        if round_:
            prev = old - 20_000 * 7919
            tier, slot = store._locate(prev)
            keep = slot >= 0
            store._remove(prev[keep], tier[keep], slot[keep])
        store.lookup_train(old, torch.ones_like(old), None)
    _check_index(store)
    assert store.index.nbytes / len(store.index) <= 16


def _device_hits_after(policy: str, hot_first: int, hot_every_step: bool, steps: int) -> int:
    """Tier of a `hot` id after a stream of one-off ids flows through an 8-row device tier."""
    table = TableConfig(name="t", embedding_dim=2, feature_names=["item"], device_rows=8, host_rows=8,
                        cache_policy=policy)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[table], ssd_slab_rows=8))
    store = tec.stores["t"]
    store.keep_host_hits = False  # as on CUDA: host hits move up, so the device tier evicts
    hot = 7
    tec(_kjt(["item"], [[hot] * hot_first])).get("item").values().sum().backward()
    for step in range(steps):
        ids = ([hot] if hot_every_step else []) + [1000 + 3 * step + k for k in range(3)]
        tec(_kjt(["item"], [ids])).get("item").values().sum().backward()
    _check_index(store)
    return int(store._locate(torch.tensor([hot]))[0][0])


def test_native_clock_keeps_recent_and_frequent_rows_on_the_device():
    # lru (CLOCK): a row used by every step stays while 120 one-off ids pass through.
    assert _device_hits_after("lru", 1, True, 40) == 0
    # lfu (generalized CLOCK): a row seen 6 times survives a burst of 12 new ids without
    # being used, where recency alone (lru) lets it go.
    assert _device_hits_after("lfu", 6, False, 4) == 0
    assert _device_hits_after("lru", 6, False, 4) != 0


def test_clock_counts_what_every_lookup_path_references(tmp_path):
    """The rows-through-PyTorch path (CUDA's) takes a fast path when every id is resident;
    its hits must count for CLOCK as the native lookup's do, or hot rows look unreferenced
    and are pushed down: the same stream gives the same hits and reference counts."""
    g = torch.Generator().manual_seed(0)
    stream = [torch.arange(16) if s % 2 == 0 else torch.randint(1000, 100000, (16,), generator=g).unique()
              for s in range(200)]
    stores = []
    for native_rows in (True, False):
        cfg = TableConfig(name="t", embedding_dim=4, feature_names=["a"], device_rows=64, host_rows=4096)
        (tmp_path / str(native_rows)).mkdir()
        store = TableStore(cfg, str(tmp_path / str(native_rows)), 1024, torch.device("cpu"), kernels="native")
        store.keep_host_hits, store.native_rows = False, native_rows  # False, False: as on CUDA
        for ids in stream:
            store.lookup_train(ids, torch.ones_like(ids), None)
            store.apply_grad(ids, torch.zeros(ids.numel(), 4), None)
        stores.append(store)
    fused, torch_rows = stores
    assert torch_rows.hits.tolist() == fused.hits.tolist() and fused.hits[0] > 0.9 * fused.hits.sum()
    assert all(torch.equal(a, b) for a, b in zip(fused.clock_ref, torch_rows.clock_ref))


def test_missing_native_library_is_an_error_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "__file__", str(tmp_path / "native.py"))
    table = TableConfig(name="t", embedding_dim=2, feature_names=["item"])
    with pytest.raises(native.NativeKernelError, match="not built.*pip install -e .*kernels"):
        TieredEmbeddingCollection(SparseConfig(tables=[table]))
    monkeypatch.undo()
    ref = TieredEmbeddingCollection(SparseConfig(tables=[table], kernels="reference"))
    assert not ref.stores["t"].native


def test_unknown_kernels_value_names_the_key():
    table = TableConfig(name="t", embedding_dim=2, feature_names=["item"])
    with pytest.raises(ValueError, match="kernels"):
        TieredEmbeddingCollection(SparseConfig(tables=[table], kernels="fast"))


def test_reference_kernels_say_so(capfd, monkeypatch):
    monkeypatch.setattr(native, "_reference_noted", False)
    table = TableConfig(name="t", embedding_dim=2, feature_names=["item"])
    TieredEmbeddingCollection(dataclasses.replace(SparseConfig(tables=[table]), kernels="reference"))
    assert "kernels='reference'" in capfd.readouterr().err


def test_native_slab_io_matches_the_per_slab_loop(tmp_path):
    """Gathers and scatters over many SSD slabs in one native call, against the per-slab loop."""
    from genrec.sparse.tiers import Tier

    native.load()
    tiers = {io: Tier("ssd", 5, None, torch.device("cpu"), str(tmp_path / f"t{io}"), slab_rows=16, native_io=io)
             for io in (True, False)}
    g = torch.Generator().manual_seed(0)
    for tier in tiers.values():
        tier.alloc(200)  # 13 slabs
    slots = torch.randperm(200, generator=g)[:120]
    rows = torch.randn(120, 5, generator=g)
    for tier in tiers.values():
        tier.rows.scatter(slots, rows)
        tier.meta.scatter(slots, torch.arange(360).view(120, 3))
    probe = torch.randint(0, 200, (300,), generator=g)
    assert tiers[True].rows.native_io and not tiers[False].rows.native_io
    assert torch.equal(tiers[True].rows.gather(probe), tiers[False].rows.gather(probe))
    assert torch.equal(tiers[True].meta.gather(probe), tiers[False].meta.gather(probe))
    assert torch.equal(tiers[True].rows.gather(slots), rows)


def test_the_sharded_path_keeps_its_native_locations_across_the_other_lookups_step(monkeypatch):
    """Several ranks look rows up through `lookup_train` and step them with `apply_grad`.
    A step's two lookups (history, then negatives) are stepped last one first; the first
    lookup's locations stay valid across the second's optimizer step (values are read in
    place), so neither backward locates its rows again, and the rows equal those of steps
    that do locate them again."""
    table = TableConfig(name="t", embedding_dim=8, feature_names=["item"], seed=3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    steps = [(torch.randperm(100, generator=g)[:30], torch.randperm(100, generator=g)[:20]) for _ in range(5)]
    rows = {}
    for reuse in (True, False):
        store = TieredEmbeddingCollection(SparseConfig(tables=[table])).stores["t"]
        store.lookup_train(torch.arange(100), torch.ones(100, dtype=torch.int64), None)  # every row exists
        store.apply_grad(torch.arange(100), torch.zeros(100, 8), None)
        located = []
        get = store.index.get
        monkeypatch.setattr(store.index, "get", lambda *a: located.append(1) or get(*a))
        for a, b in steps:
            calls = []
            for ids in (a.sort().values, b.sort().values):
                vals, admitted = store.lookup_train(ids, torch.ones_like(ids), None)
                assert bool(admitted.all())
                calls.append((ids, vals, store.last_locations))
            for ids, vals, loc in reversed(calls):
                store.apply_grad(ids, (vals * 0.5 + 0.1).float(), None, loc if reuse else None)
        assert (len(located) == 0) == reuse, f"{len(located)} backwards located their rows again"
        ids, r, _ = store.all_rows()
        rows[reuse] = r[ids.argsort()]
    assert torch.equal(rows[True], rows[False])


def _rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from Linux /proc")
def test_a_memory_tier_takes_memory_for_the_rows_it_holds_not_its_capacity():
    """A 1M-row host tier (the default capacity, 272 MB here) reads zero rows and empty ids,
    and costs the process only the pages its written slots touch: a fill of the whole
    capacity at start took 15 s for the demo's tables."""
    from genrec.sparse.tiers import Tier

    before = _rss_bytes()
    tier = Tier("host", 64, 1 << 20, torch.device("cpu"))
    assert _rss_bytes() - before < 32 << 20  # the ids array (-1) is filled: 8 MB
    slots = tier.alloc(1000)
    assert torch.equal(tier.rows.gather(slots), torch.zeros(1000, 64))
    assert torch.equal(tier.meta.gather(slots), torch.zeros_like(tier.meta.gather(slots)))
    assert bool((tier.ids.gather(slots) == -1).all())
    rows = torch.randn(1000, 64)
    tier.rows.scatter(slots, rows)
    assert torch.equal(tier.rows.gather(slots), rows)
    far = torch.tensor([(1 << 20) - 1])
    assert torch.equal(tier.rows.gather(far), torch.zeros(1, 64))
    assert _rss_bytes() - before < 48 << 20
