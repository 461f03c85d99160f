"""Exact resume (save -> load -> continue == uninterrupted) with max_rows, TTL and admission on."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection
from test_sparse_snapshot import assert_same_state, full_state


def _batches(seed: int, num_steps: int, num_ids: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(num_steps):
        lens = torch.randint(1, 6, (4,), generator=g)
        hist = torch.randint(0, num_ids, (int(lens.sum()),), generator=g)
        negs = torch.randint(0, num_ids, (8,), generator=g)
        out.append((KeyedJaggedTensor.from_lengths_sync(keys=["item_id"], values=hist, lengths=lens),
                    KeyedJaggedTensor.from_lengths_sync(keys=["neg_item"], values=negs, lengths=torch.full((4,), 2)),
                    step * 9))
    return out


def _run(tec, batches) -> list[float]:
    """Two forwards per step (history, negatives), one backward, like the model's step."""
    losses = []
    for hist, neg, ts in batches:
        out = tec(hist, event_time=ts)["item_id"].values()
        out_neg = tec(neg, event_time=ts)["neg_item"].values()
        loss = out.sum() + out.square().sum() - 0.5 * out_neg.square().sum()
        loss.backward()
        losses.append(loss.item())
    return losses


def _resume_matches(tmp_path, make_config, batches, split: int) -> None:
    straight = TieredEmbeddingCollection(make_config())
    head = _run(straight, batches[:split])
    straight.save_snapshot(str(tmp_path))
    tail = _run(straight, batches[split:])
    resumed = TieredEmbeddingCollection(make_config())
    _run(resumed, batches[:2])  # state the load must replace
    resumed.load_snapshot(str(tmp_path))
    assert head, "nothing ran before the snapshot"
    assert _run(resumed, batches[split:]) == tail, "losses after resume differ"
    assert_same_state(full_state(straight), full_state(resumed))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_resume_with_max_rows_is_exact_whatever_the_slot_order(tmp_path, policy):
    """Every row of one step ties under LRU (and many under LFU): eviction must not break
    ties by physical slot, which a load reorders."""
    for seed in range(6):
        def make_config():
            return SparseConfig(tables=[TableConfig(
                name="item", embedding_dim=4, feature_names=["item_id", "neg_item"], device_rows=6, host_rows=6,
                max_rows=30, cache_policy=policy, learning_rate=0.05, seed=seed)], ssd_slab_rows=8)

        batches = _batches(seed, 24, 80)
        _resume_matches(tmp_path / f"{policy}{seed}", make_config, batches, split=11)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_resume_is_exact_with_max_rows_ttl_and_admission_on(tmp_path, policy):
    def make_config():
        return SparseConfig(tables=[TableConfig(
            name="item", embedding_dim=4, feature_names=["item_id", "neg_item"], device_rows=5, host_rows=5,
            max_rows=25, ttl_seconds=40, admit_min_count=2, admit_probability=0.7, admit_max_pending=20,
            cache_policy=policy, optimizer="adam", learning_rate=0.02, seed=7)], ssd_slab_rows=8)

    for split in (7, 13):
        batches = _batches(100 + split, 28, 70)
        _resume_matches(tmp_path / str(split), make_config, batches, split)
    # The stream exercises every mechanism: TTL sweeps, max_rows drops, a full counter map.
    probe = TieredEmbeddingCollection(make_config())
    store = probe.stores["item"]
    swept, real_expire = [], store.expire

    def counting_expire(now):
        swept.append(real_expire(now))
        return swept[-1]

    store.expire = counting_expire
    peak_pending = 0
    for b in batches:
        _run(probe, [b])
        peak_pending = max(peak_pending, store.pending.num_live)
    assert sum(swept) > 0 and store.misses - store.num_rows - sum(swept) > 0 and peak_pending == 20
