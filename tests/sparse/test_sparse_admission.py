"""Step protection under max_rows, admission probability, and the bounded pending counters."""

from __future__ import annotations

import math

import torch

from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection
from test_sparse_store import kjt_of, tier_of, train_step


def _sorted_rows(store):
    ids, rows, _ = store.all_rows()
    order = torch.argsort(ids)
    return ids[order], rows[order]


def test_rows_of_every_forward_of_a_step_survive_max_rows_until_backward():
    """History and negatives are two forwards of one step: the second one's max_rows drop
    must not delete the first one's rows before the step's backward applied their grads."""

    def one_step(max_rows):
        cfg = TableConfig(name="t", embedding_dim=3, feature_names=["f", "neg"], device_rows=2, host_rows=2,
                          max_rows=max_rows, learning_rate=0.1)
        tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg], ssd_slab_rows=4))
        hist = tec(kjt_of({"f": [[1, 2, 3, 4]]}))["f"].values()
        neg = tec(kjt_of({"neg": [[5, 6, 7, 8]]}))["neg"].values()
        (hist.sum() + hist.square().sum() - neg.square().sum()).backward()
        return tec

    capped, unlimited = one_step(4), one_step(None)
    ids, rows = _sorted_rows(capped.stores["t"])
    ref_ids, ref_rows = _sorted_rows(unlimited.stores["t"])
    assert ids.tolist() == list(range(1, 9)), "a row looked up in this step was dropped before its backward"
    assert torch.equal(rows, ref_rows), "every looked-up row must have received its gradient"
    # Once the step's backward has run, the next step enforces the cap again.
    train_step(capped, kjt_of({"f": [[9]]}))
    assert capped.stores["t"].num_rows <= 4
    assert tier_of(capped, "t", [9]) != ["absent"]


def _admitted_fraction(batches: list[int], min_count: int, p: float, num_ids: int) -> float:
    """Fraction of `num_ids` ids with a row after batches that each show every id k times."""
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], admit_min_count=min_count,
                      admit_probability=p, seed=11, device_rows=num_ids, host_rows=0)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg]))
    ids = list(range(num_ids))
    for k in batches:
        train_step(tec, kjt_of({"f": [ids * k]}))
    return tec.stores["t"].num_rows / num_ids


def test_admission_probability_applies_per_sighting_from_min_count_on():
    """Documented rule: from the min_count-th sighting on, each sighting of a not yet
    admitted id admits it with probability p (a batch with k such sightings: 1-(1-p)^k)."""
    p, n = 0.25, 20_000
    cases = {  # sightings per batch -> sightings at or past min_count=3 while not admitted
        (3,): 1,      # the batch that reaches min_count: one chance, not three
        (5,): 3,
        (2, 2): 2,    # reaches 3 in the second batch: sightings 3 and 4 count
        (1, 1, 1): 1,
        (2,): 0,
    }
    for batches, eligible in cases.items():
        expected = 1.0 - (1.0 - p) ** eligible
        got = _admitted_fraction(list(batches), 3, p, n)
        tolerance = 4.5 * math.sqrt(expected * (1.0 - expected) / n)  # 4.5 binomial standard deviations
        assert abs(got - expected) <= tolerance, f"batches {batches}: admitted {got:.4f}, expected {expected:.4f}"


def test_admission_draws_differ_between_batches():
    """min_count 1: an id seen once per batch for 3 batches gets 3 independent chances."""
    p, n = 0.25, 20_000
    expected = 1.0 - (1.0 - p) ** 3
    got = _admitted_fraction([1, 1, 1], 1, p, n)
    assert abs(got - expected) <= 4.5 * math.sqrt(expected * (1.0 - expected) / n)


def _pending(store) -> dict[int, int]:
    """id -> sightings counted so far, for ids not admitted."""
    keys, values = store.pending.items()
    counts = values[:, 0] if values.dim() == 2 else values
    return dict(zip(keys.tolist(), counts.tolist()))


def test_pending_counters_expire_with_ttl():
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], admit_min_count=2, ttl_seconds=100)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg]))
    store = tec.stores["t"]
    train_step(tec, kjt_of({"f": [[1, 2]]}), event_time=0)
    train_step(tec, kjt_of({"f": [[3]]}), event_time=60)
    assert _pending(store) == {1: 1, 2: 1, 3: 1}
    # At 150 the sightings at 0 are older than the TTL: they are forgotten, and a new
    # sighting of 1 starts its count again instead of admitting it.
    train_step(tec, kjt_of({"f": [[1]]}), event_time=150)
    assert tier_of(tec, "t", [1]) == ["absent"]
    assert _pending(store) == {1: 1, 3: 1}
    # Sweeps drop expired counters of ids never seen again, too.
    assert store.expire(1000) == 0  # no rows; counters are not rows
    assert _pending(store) == {}


def test_pending_counters_are_capped_dropping_least_recent_then_least_seen():
    cap = 64
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], admit_min_count=5, admit_max_pending=cap)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg]))
    store = tec.stores["t"]
    twice, once = list(range(0, 40)), list(range(100, 140))
    train_step(tec, kjt_of({"f": [twice * 2 + once]}))  # one step: 80 new counters
    kept = _pending(store)
    assert len(kept) <= cap
    assert all(kept.get(i) == 2 for i in twice), "an id seen twice was dropped before ids seen once"
    assert all(kept.get(i, 1) == 1 for i in once)
    later = list(range(200, 240))
    train_step(tec, kjt_of({"f": [later]}))
    kept = _pending(store)
    assert len(kept) <= cap
    assert all(i in kept for i in later), "the newest counters were dropped"
    assert not (any(i not in kept for i in twice) and any(i in kept for i in once)), \
        "among counters of one step, an id seen twice was dropped while one seen once was kept"


def test_admission_draws_differ_between_batches_after_a_count_lapses():
    """min_count 1, ids seen once per batch with batches further apart than the TTL: each
    sighting starts a new count, and must still be a new chance (not the draw that already
    refused the id, repeated): 3 batches admit 1-(1-p)^3 of the ids at some point."""
    p, n = 0.25, 20_000
    cfg = TableConfig(name="t", embedding_dim=2, feature_names=["f"], admit_min_count=1, admit_probability=p,
                      ttl_seconds=10, seed=11, device_rows=n, host_rows=0)
    tec = TieredEmbeddingCollection(SparseConfig(tables=[cfg]))
    store, ids, ever = tec.stores["t"], list(range(n)), set()
    for k in range(3):
        train_step(tec, kjt_of({"f": [ids]}), event_time=100 * k)
        slots, got = store.tiers[0].used_slots()
        ever |= set(got.tolist())
    expected = 1.0 - (1.0 - p) ** 3
    assert abs(len(ever) / n - expected) <= 4.5 * math.sqrt(expected * (1.0 - expected) / n), len(ever) / n
