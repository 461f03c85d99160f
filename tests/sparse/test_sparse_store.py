"""Tiered store: exactness against FBGEMM's row-wise Adagrad, policies, eval purity, bad input."""

from __future__ import annotations

import random

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection
from genrec.sparse import optim
from genrec.sparse.hashing import TensorHashMap, owner_rank


def kjt_of(features: dict[str, list[list[int]]]) -> KeyedJaggedTensor:
    keys = list(features)
    lengths = [len(seq) for k in keys for seq in features[k]]
    values = [x for k in keys for seq in features[k] for x in seq]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64)
    )


def tier_of(tec: TieredEmbeddingCollection, table: str, ids: list[int]) -> list[str]:
    tier, slot = tec.stores[table]._locate(torch.tensor(ids))
    return ["absent" if s < 0 else ("device", "host", "ssd")[t] for t, s in zip(tier.tolist(), slot.tolist())]


def train_step(tec, kjt, weight_D=None, event_time=None):
    out = tec(kjt, event_time=event_time)
    loss = sum((jt.values() * (weight_D if weight_D is not None else 1.0)).sum() + 0.5 * jt.values().square().sum()
               for jt in out.values())
    loss.backward()
    return out


# ------------------------------------------------------------------------ hash map


def test_hash_map_matches_dict_under_random_inserts_and_removals():
    rng = random.Random(0)
    m, ref = TensorHashMap(8), {}
    for _ in range(40):
        new = list({rng.randrange(1 << 62) for _ in range(rng.randrange(1, 300))} - set(ref))
        m.insert_new(torch.tensor(new, dtype=torch.int64), torch.tensor([k % 1000 for k in new]))
        ref.update({k: k % 1000 for k in new})
        gone = rng.sample(sorted(ref), len(ref) // 3)
        m.remove_slots(m.find_slots(torch.tensor(gone, dtype=torch.int64)))
        for k in gone:
            del ref[k]
    probe = sorted(ref) + [rng.randrange(1 << 62) for _ in range(500)]
    got = m.get(torch.tensor(probe, dtype=torch.int64)).tolist()
    assert got == [ref.get(k, -1) for k in probe]
    assert len(m) == len(ref)


def test_a_ranks_ids_spread_over_every_home_slot():
    """The map's home slots share no bits with `owner_rank`: the ids one of 2 or 4 ranks
    owns land on home slots of every residue, not only on those of the rank's bits."""
    ids = torch.arange(200_000, dtype=torch.int64) * 7919
    m = TensorHashMap(capacity=1 << 12)
    for world in (2, 4):
        mine = ids[owner_rank(ids, world) == 1]
        counts = torch.bincount(m._home(mine) % world, minlength=world)
        assert counts.min() > 0.8 * mine.numel() / world, (world, counts)


def test_owner_rank_is_stable_and_balanced():
    ids = torch.arange(100_000)
    r = owner_rank(ids, 2)
    assert torch.equal(r, owner_rank(ids.clone(), 2))
    assert 0.48 < r.float().mean().item() < 0.52
    # pinned values: a change of hash would silently reshuffle every saved shard
    assert owner_rank(torch.tensor([0, 1, 2, 3, 12345]), 7).tolist() == [4, 4, 2, 4, 6]


# ------------------------------------------------------------------------ exactness


def _reference_tbe(num_rows, dim, lr, init_RD):
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(num_rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=lr,
        eps=1e-8,
        pooling_mode=PoolingMode.NONE,
    )
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(init_RD)
    return tbe


def _tbe_lookup(tbe, ids):
    offsets = torch.arange(ids.numel() + 1, dtype=torch.int64)
    return tbe(ids, offsets)


@pytest.mark.parametrize("tiers", ["spill", "host_only"])
def test_store_matches_fbgemm_rowwise_adagrad(tiers):
    """spill: caches far smaller than the working set, every tier used. host_only: no
    device tier, all rows resident in host (the fast path that reuses forward rows in
    backward). Two features share one table; a second forward per step (negatives) whose
    rows overlap the first, so a stale forward copy would lose an update; 25 steps."""
    n_item, n_adv, d_item, d_adv = 300, 40, 8, 4
    spill = tiers == "spill"
    item = TableConfig(name="item", embedding_dim=d_item, feature_names=["item_id", "neg_item"],
                       num_embeddings=n_item, device_rows=8 if spill else 0, host_rows=16 if spill else n_item,
                       learning_rate=0.05, seed=3)
    adv = TableConfig(name="adv", embedding_dim=d_adv, feature_names=["advertiser_id"], num_embeddings=n_adv,
                      device_rows=4 if spill else 0, host_rows=4 if spill else n_adv, learning_rate=0.1, seed=4)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[item, adv], ssd_slab_rows=32))
    ref_item = _reference_tbe(n_item, d_item, 0.05, optim.initial_values(item, torch.arange(n_item)))
    ref_adv = _reference_tbe(n_adv, d_adv, 0.1, optim.initial_values(adv, torch.arange(n_adv)))
    g = torch.Generator().manual_seed(0)
    if not spill:  # materialize every row first so that each step takes the resident path
        for name, n in (("item", n_item), ("adv", n_adv)):
            tec.stores[name].lookup_train(torch.arange(n), torch.ones(n, dtype=torch.int64), None)
    for _ in range(25):
        B = 5
        lens = torch.randint(0, 7, (B,), generator=g)
        n = int(lens.sum())
        items = torch.randint(0, n_item, (n,), generator=g)
        advs = torch.randint(0, n_adv, (n,), generator=g)
        negs = torch.randint(0, n_item, (B * 3,), generator=g)
        w_item, w_adv = torch.randn(d_item, generator=g), torch.randn(d_adv, generator=g)
        hist = KeyedJaggedTensor.from_lengths_sync(keys=["item_id", "advertiser_id"], values=torch.cat([items, advs]),
                                                   lengths=torch.cat([lens, lens]))
        neg = KeyedJaggedTensor.from_lengths_sync(keys=["neg_item"], values=negs, lengths=torch.full((B,), 3))
        out = tec(hist)
        out_neg = tec(neg)
        loss = ((out["item_id"].values() * w_item).sum() + (out["advertiser_id"].values() * w_adv).sum()
                + (out["item_id"].values() ** 2).sum() - (out_neg["neg_item"].values() * w_item).sum())
        loss.backward()
        r_items, r_advs, r_negs = _tbe_lookup(ref_item, items), _tbe_lookup(ref_adv, advs), _tbe_lookup(ref_item, negs)
        ref_loss = ((r_items * w_item).sum() + (r_advs * w_adv).sum() + (r_items**2).sum() - (r_negs * w_item).sum())
        ref_loss.backward()
    for name, ref in (("item", ref_item), ("adv", ref_adv)):
        store = tec.stores[name]
        ids, rows, _ = store.all_rows()
        if spill:
            assert ids.numel() > store.tiers[0].capacity + store.tiers[1].capacity, "test must spill to SSD"
            assert store.tiers[2].num_used > 0 and store.hits[2] > 0
        else:
            assert store.tiers[1].num_used == ids.numel() and store.misses == ids.numel()
        d = store.dim
        torch.testing.assert_close(rows[:, :d], ref.split_embedding_weights()[0][ids], atol=1e-6, rtol=0)
        torch.testing.assert_close(rows[:, d], ref.split_optimizer_states()[0][0][ids], atol=1e-6, rtol=1e-6)


def test_adam_and_sgd_match_dense_reference():
    for opt in ("adam", "sgd"):
        cfg = TableConfig(name="t", embedding_dim=4, feature_names=["f"], num_embeddings=50, optimizer=opt,
                          device_rows=3, host_rows=3, learning_rate=0.1)
        tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=8))
        w = optim.initial_values(cfg, torch.arange(50)).requires_grad_(True)
        ref_opt = torch.optim.Adam([w], lr=0.1, eps=1e-8) if opt == "adam" else torch.optim.SGD([w], lr=0.1)
        ids = torch.arange(50)
        kjt = kjt_of({"f": [ids.tolist()]})
        # every row is touched every step, so per-row Adam steps equal the global step
        for _ in range(4):
            train_step(tec, kjt)
            ref_opt.zero_grad()
            (w.sum() + 0.5 * w.square().sum()).backward()
            ref_opt.step()
        got_ids, rows, _ = tec.stores["t"].all_rows()
        torch.testing.assert_close(rows[:, :4], w.detach()[got_ids], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------ semantics


def test_initial_rows_do_not_depend_on_arrival_order_or_tier_sizes():
    cfgs = [TableConfig(name="t", embedding_dim=6, feature_names=["f"], device_rows=dr, host_rows=hr)
            for dr, hr in ((2, 2), (1000, 1000))]
    a = TieredEmbeddingCollection(SparseConfig(tables=[cfgs[0]], ssd_slab_rows=4))
    b = TieredEmbeddingCollection(SparseConfig(tables=[cfgs[1]]))
    ids = [5, 900, 1 << 40, 17, 3]
    ra = a(kjt_of({"f": [ids]}))["f"].values()
    rb = b(kjt_of({"f": [ids[::-1]]}))["f"].values().flip(0)
    assert torch.equal(ra, rb)
    assert ra.abs().max() > 0


def test_eval_and_no_grad_change_no_state_and_read_default_row():
    cfg = TableConfig(name="t", embedding_dim=4, feature_names=["f"], device_rows=2, host_rows=2,
                      admit_min_count=2)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=4))
    train_step(tec, kjt_of({"f": [[1, 1, 2, 3, 3, 4, 4, 5, 5]]}))  # 1,3,4,5 admitted; 2 pending
    store = tec.stores["t"]

    def state():
        ids, rows, meta = store.all_rows()
        p = store.pending.items()
        return ids.tolist(), rows.tolist(), meta.tolist(), p[0].tolist(), p[1].tolist(), store.step

    before = state()
    probe = kjt_of({"f": [[1, 2, 99, 5]]})
    with torch.no_grad():
        out = tec(probe)["f"].values()
    tec.eval()
    out_eval = tec(probe)["f"].values()
    tec.train()
    assert state() == before
    assert torch.equal(out, out_eval)
    assert torch.equal(out[1], torch.zeros(4)) and torch.equal(out[2], torch.zeros(4))
    assert out[0].abs().sum() > 0 and out[3].abs().sum() > 0


def test_admission_by_min_count():
    cfg = TableConfig(name="t", embedding_dim=4, feature_names=["f"], admit_min_count=3, learning_rate=0.1)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg]))
    for step in range(2):
        out = train_step(tec, kjt_of({"f": [[7]]}))
        assert torch.equal(out["f"].values().detach(), torch.zeros(1, 4)), f"step {step}: unadmitted id read a row"
        assert tier_of(tec, "t", [7]) == ["absent"]
    out = train_step(tec, kjt_of({"f": [[7]]}))  # third sighting: admitted, starts from its init row
    assert torch.equal(out["f"].values().detach(), optim.initial_values(cfg, torch.tensor([7])))
    assert tier_of(tec, "t", [7]) == ["device"]
    # the update of the admitting step was applied
    assert not torch.equal(tec.stores["t"].lookup_eval(torch.tensor([7]), None), out["f"].values().detach())
    # a batch with the id twice counts two sightings
    train_step(tec, kjt_of({"f": [[8, 8], [8]]}))
    assert tier_of(tec, "t", [8]) == ["device"]


def test_admission_by_probability_is_deterministic_and_near_p():
    def admitted():
        cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], admit_probability=0.25)
        tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg]))
        train_step(tec, kjt_of({"f": [list(range(4000))]}))
        return tec.stores["t"].all_rows()[0].sort().values

    a, b = admitted(), admitted()
    assert torch.equal(a, b)
    assert 0.22 < a.numel() / 4000 < 0.28


# The two tests below pin the exact policy order of the reference kernels; the native
# kernels' CLOCK victims are tested in test_sparse_native.py.
def test_lru_demotes_least_recently_used_through_every_tier():
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], device_rows=2, host_rows=2, cache_policy="lru")
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=4, kernels="reference"))
    for i in [1, 2, 3, 4, 5]:
        train_step(tec, kjt_of({"f": [[i]]}))
    assert tier_of(tec, "t", [1, 2, 3, 4, 5]) == ["ssd", "host", "host", "device", "device"]
    train_step(tec, kjt_of({"f": [[1]]}))  # 1 comes up from SSD; 4 (oldest on device) goes to host; 2 to SSD
    assert tier_of(tec, "t", [1, 2, 3, 4, 5]) == ["device", "ssd", "host", "host", "device"]


def test_lfu_keeps_frequent_rows_on_device():
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], device_rows=2, host_rows=1, cache_policy="lfu")
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=4, kernels="reference"))
    train_step(tec, kjt_of({"f": [[1, 1, 1, 2, 2]]}))
    for i in [3, 4]:
        train_step(tec, kjt_of({"f": [[i]]}))
    # 3 evicted 2 (count 2 < 3) from the device; 4 evicted 3 (count 1), which pushed 2 from
    # host to SSD. 1 (count 3, the oldest) never left the device: frequency wins over age.
    assert tier_of(tec, "t", [1, 2, 3, 4]) == ["device", "ssd", "host", "device"]


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_lfu_keeps_the_most_used_row_whatever_its_count(kernels, tmp_path):
    """Counts of 2^32 and more (a heavy hitter over a long run) must not wrap the LFU score:
    a wrapped score put the most used row first in line for max_rows."""
    from genrec.sparse.store import TableStore

    cfg = TableConfig(name="t", embedding_dim=4, feature_names=["f"], cache_policy="lfu", max_rows=4,
                      device_rows=8, host_rows=8)
    store = TableStore(cfg, str(tmp_path), 16, torch.device("cpu"), kernels=kernels)
    for ids, counts in [([0], [1 << 32]), ([5], [(1 << 40) + 3]), ([1, 2], [1, 1]), ([3], [1]), ([4], [1])]:
        ids = torch.tensor(ids)
        store.lookup_train(ids, torch.tensor(counts), None)
        store.apply_grad(ids, torch.zeros(len(ids), 4), None)  # the backward closes the step
    # Five rows met max_rows 4 twice: the two least used and oldest (1, then 2) left.
    assert sorted(store.all_rows()[0].tolist()) == [0, 3, 4, 5]


def test_ttl_drops_rows_from_every_tier_and_reinitializes():
    cfg = TableConfig(name="t", embedding_dim=3, feature_names=["f"], device_rows=1, host_rows=1, ttl_seconds=100,
                      learning_rate=0.5)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=4))
    train_step(tec, kjt_of({"f": [[1]]}), event_time=0)
    train_step(tec, kjt_of({"f": [[2]]}), event_time=10)
    train_step(tec, kjt_of({"f": [[3]]}), event_time=60)
    assert tier_of(tec, "t", [1, 2, 3]) == ["ssd", "host", "device"]
    tec.eval()
    at_105 = tec(kjt_of({"f": [[1, 2]]}), event_time=105)["f"].values()
    tec.train()
    assert torch.equal(at_105[0], torch.zeros(3)), "an expired row must read the default row"
    assert at_105[1].abs().sum() > 0
    assert tec.stores["t"].expire(115) == 2  # 1 (SSD) and 2 (host) are gone, 3 stays
    assert tier_of(tec, "t", [1, 2, 3]) == ["absent", "absent", "device"]
    out = train_step(tec, kjt_of({"f": [[1]]}), event_time=120)
    assert torch.equal(out["f"].values().detach(), optim.initial_values(cfg, torch.tensor([1])))
    ids, rows, _ = tec.stores["t"].all_rows()
    assert rows[ids.tolist().index(1), 3].item() > 0  # momentum restarted from this one update
    assert rows[ids.tolist().index(1), 3].item() == pytest.approx(1.0 * 1.0, rel=0.5)


def test_max_rows_drops_least_recent_rows():
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], device_rows=2, host_rows=2, max_rows=3)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=4))
    for i in [1, 2, 3, 4, 5]:
        train_step(tec, kjt_of({"f": [[i]]}))
    assert tier_of(tec, "t", [1, 2, 3, 4, 5]) == ["absent", "absent", "host", "device", "device"]


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_max_rows_keeps_the_same_rows_whatever_the_cache_sizes(kernels):
    """A step whose own rows exceed max_rows leaves the table over it; the next lookup trims
    it whichever path serves it (rows in place or moved): the cache sizes must not decide
    which rows survive, nor their values."""
    def run(device_rows, host_rows):
        cfg = TableConfig(name="t", embedding_dim=4, feature_names=["f"], device_rows=device_rows,
                          host_rows=host_rows, max_rows=8, learning_rate=0.1, seed=1)
        tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=4, kernels=kernels))
        outs = [train_step(tec, kjt_of({"f": [ids]}))["f"].values().detach()
                for ids in (list(range(12)), [11], [11], [1], [2])]
        ids, rows, _ = tec.stores["t"].all_rows()
        order = torch.argsort(ids)
        return outs, ids[order], rows[order]

    (outs_a, ids_a, rows_a), (outs_b, ids_b, rows_b) = run(16, 16), run(1, 1)
    assert ids_a.tolist() == ids_b.tolist() and len(ids_a) <= 8
    assert torch.equal(rows_a, rows_b) and all(torch.equal(x, y) for x, y in zip(outs_a, outs_b))


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_an_empty_lookup_of_an_ssd_only_table_trains(kernels, tmp_path):
    """A rank that owns none of a batch's ids looks up nothing; tables planned onto the SSD
    tier alone (no device or host rows) must take that too."""
    cfg = TableConfig(name="t", embedding_dim=4, feature_names=["f"], device_rows=0, host_rows=0)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=4, kernels=kernels,
                                                 ssd_dir=str(tmp_path)))
    train_step(tec, kjt_of({"f": [[1, 2]]}))
    out = train_step(tec, kjt_of({"f": [[]]}))
    assert out["f"].values().shape == (0, 4)
    train_step(tec, kjt_of({"f": [[2, 3]]}))
    assert tier_of(tec, "t", [1, 2, 3]) == ["ssd", "ssd", "ssd"]


def test_a_snapshot_saved_between_a_forward_and_its_backward_loses_no_update(tmp_path):
    """The open step's rows are saved before their update: the next delta carries them."""
    cfg = TableConfig(name="t", embedding_dim=4, feature_names=["f"], device_rows=4, host_rows=4,
                      learning_rate=0.1, seed=1)
    sparse = SparseConfig(tables=[cfg], ssd_slab_rows=4, snapshot_max_deltas=4)
    tec = TieredEmbeddingCollection(sparse)
    train_step(tec, kjt_of({"f": [[1, 2, 3]]}))
    out = tec(kjt_of({"f": [[1, 2]]}))
    tec.save_snapshot(str(tmp_path / "s"))  # between the forward and its backward
    (out["f"].values().sum() + out["f"].values().square().sum()).backward()
    train_step(tec, kjt_of({"f": [[3]]}))
    tec.save_snapshot(str(tmp_path / "s"))  # a delta on the first
    restored = TieredEmbeddingCollection(sparse)
    restored.load_snapshot(str(tmp_path / "s"))
    live, back = (t.stores["t"].all_rows() for t in (tec, restored))
    order_live, order_back = torch.argsort(live[0]), torch.argsort(back[0])
    assert torch.equal(live[0][order_live], back[0][order_back])
    assert torch.equal(live[1][order_live], back[1][order_back])


def test_prefetch_brings_rows_up_without_changing_values():
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], device_rows=2, host_rows=2)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=4))
    for i in [1, 2, 3, 4, 5]:
        train_step(tec, kjt_of({"f": [[i]]}))
    before = tec.stores["t"].lookup_eval(torch.tensor([1]), None)
    tec.prefetch(kjt_of({"f": [[1]]}))
    assert tier_of(tec, "t", [1]) == ["device"]
    assert torch.equal(tec.stores["t"].lookup_eval(torch.tensor([1]), None), before)


def test_output_layout_matches_kjt():
    cfg = TableConfig(name="t", embedding_dim=3, feature_names=["a", "b"])
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg]))
    out = tec(kjt_of({"a": [[1, 2], [], [3]], "b": [[4], [5, 6], []]}))
    assert out["a"].lengths().tolist() == [2, 0, 1] and out["b"].lengths().tolist() == [1, 2, 0]
    assert out["a"].values().shape == (3, 3)
    with torch.no_grad():
        again = tec(kjt_of({"b": [[1]]}))["b"].values()
    assert torch.equal(again[0], out["a"].values()[0].detach())  # shared table, same row


# ------------------------------------------------------------------------ bad input


def test_bad_ids_and_features_raise_naming_them():
    cfg = TableConfig(name="items", embedding_dim=2, feature_names=["item_id"], num_embeddings=10)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg]))
    with pytest.raises(ValueError, match=r"item_id.*items.*negative id -3"):
        tec(kjt_of({"item_id": [[1, -3]]}))
    with pytest.raises(ValueError, match=r"item_id.*items.*id 10 out of range"):
        tec(kjt_of({"item_id": [[10]]}))
    with pytest.raises(ValueError, match=r"feature 'campaign_id' has no table"):
        tec(kjt_of({"campaign_id": [[1]]}))
    assert tec.stores["items"].num_rows == 0


def test_bad_ssd_dir_raises_naming_path(tmp_path):
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"])
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="nope.*does not exist"):
        TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_dir=missing))
    with pytest.raises(ValueError, match="/proc.*not writable"):
        TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_dir="/proc"))
    with pytest.raises(ValueError, match="table name 't' appears twice"):
        TieredEmbeddingCollection(SparseConfig(tables=[cfg, cfg]))
    # A table's name names its SSD folder and snapshot files: no way out of ssd_dir.
    for name in ["../t", "a/b", ".hidden", ""]:
        bad = TableConfig(name=name, embedding_dim=2, feature_names=["f"])
        with pytest.raises(ValueError, match="table name .* must be letters"):
            TieredEmbeddingCollection(SparseConfig(tables=[bad], ssd_dir=str(tmp_path)))
    assert not list(tmp_path.iterdir())


def test_planner_keeps_small_tables_in_memory_and_splits_budgets():
    from genrec.sparse.planner import plan_tables

    cfg = SparseConfig(tables=[
        TableConfig(name="action", embedding_dim=8, feature_names=["action"], num_embeddings=16),
        TableConfig(name="item", embedding_dim=64, feature_names=["item_id"]),
        TableConfig(name="adv", embedding_dim=32, feature_names=["advertiser_id"], num_embeddings=1_000_000),
    ])
    planned, plans = plan_tables(cfg, device_bytes=200_000_000, host_bytes=400_000_000, world_size=2,
                                 expected_rows={"item": 100_000_000}, verbose=False)
    by = {p.name: p for p in plans}
    assert by["action"].placement == "memory" and by["action"].device_rows == 8
    assert by["adv"].placement == "memory" and by["adv"].ssd_rows == 0
    assert by["item"].placement == "tiered" and by["item"].ssd_rows > 0
    used_device = sum(p.device_rows * p.bytes_per_row for p in plans)
    used_host = sum(p.host_rows * p.bytes_per_row for p in plans)
    assert used_device <= 200_000_000 and used_host <= 400_000_000
    assert [t.device_rows for t in planned.tables] == [by[t.name].device_rows for t in cfg.tables]
    assert cfg.tables[1].device_rows == 65536  # the input config is not modified
    with pytest.raises(ValueError, match="'item' is unbounded"):
        plan_tables(cfg, device_bytes=1, host_bytes=1)


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_a_full_disk_while_the_ssd_tier_grows_loses_no_row(kernels, tmp_path, monkeypatch):
    """The lookup that must grow the SSD tier fails with ENOSPC; every row is still there,
    and the tier's arrays still have the same slabs (the rows file got its blocks, the ids
    file did not), so the lookup succeeds once the disk has room."""
    import errno
    import os

    cfg = TableConfig(name="t", embedding_dim=4, feature_names=["f"], device_rows=2, host_rows=2)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=2, ssd_dir=str(tmp_path),
                                                 kernels=kernels))
    for ids in ([1, 2], [3, 4], [5, 6]):  # 4 rows in the caches, 2 on SSD: its first slab is full
        train_step(tec, kjt_of({"f": [ids]}))
    store, ssd = tec.stores["t"], tec.stores["t"].tiers[2]
    before = store.all_rows()
    real, calls = os.posix_fallocate, []

    def full_at_the_ids_file(fd, offset, nbytes):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, nbytes)

    monkeypatch.setattr(os, "posix_fallocate", full_at_the_ids_file)
    with pytest.raises(OSError, match="No space left"):
        tec(kjt_of({"f": [[7, 8]]}))  # two new rows push two cached rows down to SSD
    monkeypatch.setattr(os, "posix_fallocate", real)
    assert len(ssd.rows.slabs) == len(ssd.ids.slabs) == len(ssd.meta.slabs)
    after = store.all_rows()
    order_b, order_a = torch.argsort(before[0]), torch.argsort(after[0])
    assert torch.equal(before[0][order_b], after[0][order_a]) and torch.equal(before[1][order_b], after[1][order_a])
    assert len(store.index) == store.num_rows == 6
    train_step(tec, kjt_of({"f": [[7, 8]]}))
    assert sorted(store.all_rows()[0].tolist()) == [1, 2, 3, 4, 5, 6, 7, 8]
