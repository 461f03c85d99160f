"""Loader: batch contents per mode against the prepared rows, sharding, determinism,
exact resume, stochastic length, and MovieLens-100K end to end."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from seqdata_helpers import AD_FEATURES, ML100K, ML_FEATURES, random_log, write_log

from genrec.data.batch import Batch
from genrec.data.config import FeatureSpec
from genrec.data.loader import LoaderConfig, make_loader
from genrec.data.prepare import SplitConfig, prepare


def split_rows(split_dir) -> dict[int, dict]:
    return {r["user_id"]: r for r in ds.dataset(split_dir).to_table().to_pylist()}


def per_user(batch: Batch, kjt_attr: str, lengths_B: torch.Tensor) -> list[dict[str, list]]:
    """Unpack a KJT of `batch` into one dict per user: key -> list of ids."""
    kjt = getattr(batch, kjt_attr)
    out = [dict() for _ in range(batch.batch_size)]
    for key, jt in kjt.to_dict().items():
        assert torch.equal(jt.lengths(), lengths_B)
        for b, ids in enumerate(jt.to_dense()):
            out[b][key] = ids.tolist()
    return out


def batch_signature(batch: Batch) -> tuple:
    parts = [batch.user_ids_B, batch.history.values(), batch.history.lengths(), batch.timestamps_T]
    parts += [x for x in (batch.candidates and batch.candidates.values(), batch.labels_CL, batch.targets_B)
              if x is not None]
    return tuple(tuple(p.flatten().tolist()) for p in parts)


@pytest.mark.parametrize("mode", ["retrieval", "ranking", "eval"])
def test_batches_match_prepared_rows(ad_prepared, mode):
    split = "test" if mode == "eval" else "train"
    rows = split_rows(ad_prepared / split)
    L, C = 9, 3
    cfg = LoaderConfig(batch_size=32, max_seq_len=L, mode=mode, num_candidates=C, shuffle=False)
    seen = Counter()
    for batch in make_loader(ad_prepared / split, AD_FEATURES, cfg):
        assert batch.history.keys() == AD_FEATURES.sparse
        hists = per_user(batch, "history", batch.history_lengths_B)
        ts = torch.split(batch.timestamps_T, batch.history_lengths_B.tolist())
        if mode != "retrieval":
            cand_lengths_B = batch.candidates.lengths()[: batch.batch_size]
            cands = per_user(batch, "candidates", cand_lengths_B)
            labels = torch.split(batch.labels_CL, cand_lengths_B.tolist())
        for b, user in enumerate(batch.user_ids_B.tolist()):
            seen[user] += 1
            row = rows[user]
            n = len(row["ts"])
            if mode == "retrieval":
                hist = slice(max(0, n - L), n)
                cand = slice(n, n)
            elif mode == "ranking":
                window = min(n, L)
                c = min(C, window - 1)
                hist, cand = slice(n - window, n - c), slice(n - c, n)
            else:
                hist, cand = slice(max(0, n - 1 - L), n - 1), slice(n - 1, n)
                assert batch.targets_B[b].item() == row["item_id"][-1]
            for key in AD_FEATURES.sparse:
                assert hists[b][key] == row[key][hist]
            assert ts[b].tolist() == row["ts"][hist]
            if mode != "retrieval":
                for key in AD_FEATURES.sparse:
                    assert cands[b][key] == row[key][cand]
                expected = [[row[lab][i] for lab in AD_FEATURES.labels] for i in range(n)[cand]]
                assert labels[b].tolist() == expected
                assert batch.labels_CL.dtype == torch.float32
    assert seen == Counter({u: 1 for u in rows}), "each user exactly once per epoch"


def test_shards_are_disjoint_and_equal_in_count(ad_prepared):
    train = ad_prepared / "train"
    all_users = set(split_rows(train))
    cfg = LoaderConfig(batch_size=8, max_seq_len=20, num_workers=2, seed=5)
    per_rank = []
    for rank in range(2):
        loader = make_loader(train, AD_FEATURES, cfg, rank=rank, world_size=2)
        num_batches = len(loader)  # of the current epoch: read it before iterating
        batches = list(loader)
        assert len(batches) == num_batches > 0
        per_rank.append([u for b in batches for u in b.user_ids_B.tolist()])
    assert len(per_rank[0]) > 0 and not set(per_rank[0]) & set(per_rank[1])
    assert len(set(per_rank[0] + per_rank[1])) == len(per_rank[0]) + len(per_rank[1])
    # equal_batches_per_rank trims only the tail of the larger rank.
    loaders = [make_loader(train, AD_FEATURES, cfg, rank=r, world_size=2) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1])
    untrimmed = replace(cfg, equal_batches_per_rank=False)
    full = [u for r in range(2) for b in make_loader(train, AD_FEATURES, untrimmed, rank=r, world_size=2)
            for u in b.user_ids_B.tolist()]
    assert set(full) == all_users


def test_deterministic_per_seed_and_reshuffled_per_epoch(ad_prepared):
    cfg = LoaderConfig(batch_size=16, max_seq_len=12, seed=3)
    a, b = (make_loader(ad_prepared / "train", AD_FEATURES, cfg) for _ in range(2))
    epoch0_a, epoch0_b = [batch_signature(x) for x in a], [batch_signature(x) for x in b]
    assert epoch0_a == epoch0_b
    epoch1 = [batch_signature(x) for x in a]
    assert a.epoch == 2 and epoch1 != epoch0_a
    other_seed = make_loader(ad_prepared / "train", AD_FEATURES, replace(cfg, seed=4))
    assert [batch_signature(x) for x in other_seed] != epoch0_a


@pytest.mark.parametrize("num_workers, stop_at", [(0, 5), (2, 7), (2, 0)])
def test_resume_continues_exactly(ad_prepared, num_workers, stop_at):
    cfg = LoaderConfig(batch_size=8, max_seq_len=30, mode="ranking", num_candidates=2, seed=11,
                       num_workers=num_workers, stochastic_length_prob=0.5, stochastic_length_min=4)
    kwargs = dict(rank=1, world_size=2)
    reference = make_loader(ad_prepared / "train", AD_FEATURES, cfg, **kwargs)
    uninterrupted = [batch_signature(b) for _ in range(2) for b in reference]

    first = make_loader(ad_prepared / "train", AD_FEATURES, cfg, **kwargs)
    it = iter(first)
    got = [batch_signature(next(it)) for _ in range(stop_at)]
    state = first.state_dict()
    del it
    resumed = make_loader(ad_prepared / "train", AD_FEATURES, cfg, **kwargs)
    resumed.load_state_dict(state)
    for _ in range(2 - resumed.epoch):
        got += [batch_signature(b) for b in resumed]
    assert got == uninterrupted


def test_few_row_groups_are_sliced_across_workers(tmp_path):
    """One row group per file and more global workers than row groups: units become row
    slices, every user is still read exactly once, and resume still holds."""
    write_log(random_log(45, 900, seed=9), tmp_path / "log")
    prepare(tmp_path / "log", tmp_path / "out", AD_FEATURES, SplitConfig(), num_shards=1, progress=False)
    train = tmp_path / "out" / "train"
    cfg = LoaderConfig(batch_size=4, max_seq_len=8, num_workers=2, equal_batches_per_rank=False)
    users = [u for r in range(2) for b in make_loader(train, AD_FEATURES, cfg, rank=r, world_size=2)
             for u in b.user_ids_B.tolist()]
    assert sorted(users) == sorted(split_rows(train))
    loader = make_loader(train, AD_FEATURES, cfg, rank=1, world_size=2)
    assert len(loader.dataset.units) >= 16
    full = [batch_signature(b) for b in loader]
    first = make_loader(train, AD_FEATURES, cfg, rank=1, world_size=2)
    it = iter(first)
    head = [batch_signature(next(it)) for _ in range(3)]
    resumed = make_loader(train, AD_FEATURES, cfg, rank=1, world_size=2)
    resumed.load_state_dict(first.state_dict())
    assert head + [batch_signature(b) for b in resumed] == full


def _draw(loaders, steps: int):
    """Every rank draws `steps` batches, as synchronous training does: (users, rank 0's state)."""
    iterators = [iter(loader) for loader in loaders]
    users = [u for it in iterators for _ in range(steps) for u in next(it).user_ids_B.tolist()]
    return users, loaders[0].state_dict()


@pytest.mark.parametrize("plans", [
    ((1, 0), (2, 0)), ((2, 0), (1, 0)), ((2, 0), (4, 0)), ((4, 0), (1, 0)), ((1, 0), (4, 0)),
    ((4, 0), (2, 0)), ((2, 0), (1, 0), (4, 0)), ((2, 2), (1, 0)), ((2, 0), (3, 0)), ((4, 0), (3, 0)),
    ((3, 0), (2, 0)), ((3, 2), (2, 0)),
])
@pytest.mark.parametrize("equal", [False, True])
def test_resume_on_another_world_size_reads_no_row_twice(ad_prepared, plans, equal):
    """A position saved by N ranks (or another worker count) and restored on M: the rest
    of the epoch is exactly the rows the saved plan had not read (all of them without
    equal_batches_per_rank; none twice with it), also through a chain N -> M -> K."""
    train = ad_prepared / "train"
    cfg = LoaderConfig(batch_size=4, max_seq_len=10, seed=2, equal_batches_per_rank=equal)
    users, state = [], None
    for i, (world, workers) in enumerate(plans):
        loaders = [make_loader(train, AD_FEATURES, replace(cfg, num_workers=workers), rank=r, world_size=world)
                   for r in range(world)]
        for loader in loaders if state is not None else []:
            loader.load_state_dict(state)
        assert all(loader.epoch == 0 for loader in loaders)
        if i + 1 < len(plans):
            drawn, state = _draw(loaders, 3)
            users += drawn
        else:
            lengths = {len(loader) for loader in loaders}
            users += [u for loader in loaders for b in loader for u in b.user_ids_B.tolist()]
            assert all(loader.epoch == 1 for loader in loaders)
            assert not equal or len(lengths) == 1  # collective steps: every rank the same count
    assert len(users) == len(set(users)), "a row was read twice in one epoch"
    everyone = set(split_rows(train))
    assert set(users) <= everyone
    if not equal:
        assert set(users) == everyone
    else:  # the rest is dealt by rows: the cut drops less than a batch per worker of the plan
        world, workers = plans[-1]
        assert len(everyone) - len(users) < world * max(workers, 1) * cfg.batch_size, (len(everyone), len(users))
    # The next epoch is this plan's own: the same batches as a loader that never resized.
    world, workers = plans[-1]
    fresh = make_loader(train, AD_FEATURES, replace(cfg, num_workers=workers), rank=0, world_size=world)
    fresh.set_epoch(1)
    assert [batch_signature(b) for b in loaders[0]] == [batch_signature(b) for b in fresh]


def test_a_resume_position_saved_before_pieces_had_a_take_column_loads(ad_prepared):
    train = ad_prepared / "train"
    cfg = LoaderConfig(batch_size=4, max_seq_len=10, seed=2)
    _, state = _draw([make_loader(train, AD_FEATURES, cfg, rank=r, world_size=2) for r in range(2)], 3)
    one = make_loader(train, AD_FEATURES, cfg)
    one.load_state_dict(state)
    next(iter(one))
    state = one.state_dict()
    old = dict(state, pieces=state["pieces"][:, :6])  # a whole piece reads the rest of its unit
    resumed = [make_loader(train, AD_FEATURES, cfg) for _ in range(2)]
    for loader, s in zip(resumed, (state, old)):
        loader.load_state_dict(s)
    a, b = ([batch_signature(x) for x in loader] for loader in resumed)
    assert a == b and len(a) > 10


def test_resume_state_must_match_setting(ad_prepared):
    loader = make_loader(ad_prepared / "train", AD_FEATURES, LoaderConfig(batch_size=8))
    state = loader.state_dict()
    other = make_loader(ad_prepared / "train", AD_FEATURES, LoaderConfig(batch_size=16))
    with pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(state)
    unshuffled = make_loader(ad_prepared / "train", AD_FEATURES, LoaderConfig(batch_size=8, shuffle=False))
    with pytest.raises(ValueError, match="shuffle"):
        unshuffled.load_state_dict(state)


def test_a_position_over_other_data_is_refused(ad_prepared, tmp_path):
    """The same directory prepared again (other rows, other row groups): the saved position
    would silently name other rows, so it is refused, naming the directory."""
    state = make_loader(ad_prepared / "train", AD_FEATURES, LoaderConfig(batch_size=8)).state_dict()
    other = tmp_path / "train"
    other.mkdir()
    files = sorted((ad_prepared / "train").glob("*.parquet"))
    for f in files[:-1] if len(files) > 1 else files:
        table = pq.read_table(f)
        pq.write_table(table.slice(0, table.num_rows - 1), other / f.name)
    with pytest.raises(ValueError, match="other data"):
        make_loader(other, AD_FEATURES, LoaderConfig(batch_size=8)).load_state_dict(state)


def test_stochastic_length_keeps_most_recent(ad_prepared):
    rows = split_rows(ad_prepared / "train")
    L, m = 30, 5
    cfg = LoaderConfig(batch_size=64, max_seq_len=L, stochastic_length_prob=0.7, stochastic_length_min=m)
    cut = kept = 0
    for batch in make_loader(ad_prepared / "train", AD_FEATURES, cfg):
        items = torch.split(batch.history.to_dict()["item_id"].values(), batch.history_lengths_B.tolist())
        for user, hist in zip(batch.user_ids_B.tolist(), items):
            full = rows[user]["item_id"]
            window = min(len(full), L)
            assert hist.tolist() == full[len(full) - len(hist):], "history must be the most recent events"
            if window <= m:
                assert len(hist) == window
            else:
                assert m <= len(hist) <= window
                cut += len(hist) < window
                kept += len(hist) == window
    assert cut > 0 and kept > 0


def test_bad_inputs(ad_prepared, tmp_path):
    with pytest.raises(ValueError, match="no parquet files"):
        make_loader(tmp_path, AD_FEATURES, LoaderConfig())
    wrong = replace(AD_FEATURES, sparse=["item_id", "campaign_id"])
    with pytest.raises(ValueError, match="part-00000.parquet: missing column 'campaign_id'"):
        make_loader(ad_prepared / "train", wrong, LoaderConfig())
    with pytest.raises(ValueError, match="num_candidates"):
        make_loader(ad_prepared / "train", AD_FEATURES, LoaderConfig(mode="ranking", num_candidates=0))
    with pytest.raises(ValueError, match="rank 2 outside"):
        make_loader(ad_prepared / "train", AD_FEATURES, LoaderConfig(), rank=2, world_size=2)


def test_movielens_eval_targets_and_ranking(ml100k_prepared):
    raw = np.loadtxt(ML100K, dtype=np.int64)
    by_user = defaultdict(list)
    # Stable sort by ts: ties keep file order, as prepare does.
    for user, item, rating, ts in raw[np.argsort(raw[:, 3], kind="stable")]:
        by_user[user].append((item, rating))
    cfg = LoaderConfig(batch_size=100, max_seq_len=50, mode="eval", shuffle=False)
    targets, lengths = {}, {}
    for batch in make_loader(ml100k_prepared / "test", ML_FEATURES, cfg):
        for u, t, n in zip(batch.user_ids_B.tolist(), batch.targets_B.tolist(), batch.history_lengths_B.tolist()):
            targets[u], lengths[u] = t, n
        clicks = batch.labels_CL[:, 0]
        assert set(clicks.tolist()) <= {0.0, 1.0} and batch.labels_CL.shape == (batch.batch_size, 1)
    assert len(targets) == 943
    assert targets == {u: ev[-1][0] for u, ev in by_user.items()}
    assert lengths == {u: min(len(ev) - 1, 50) for u, ev in by_user.items()}

    # valid targets are the second-to-last item.
    cfg = replace(cfg, num_workers=2)
    valid = {u: t for b in make_loader(ml100k_prepared / "valid", ML_FEATURES, cfg)
             for u, t in zip(b.user_ids_B.tolist(), b.targets_B.tolist())}
    assert valid == {u: ev[-2][0] for u, ev in by_user.items()}

    # Ranking over train, two ranks: candidates carry click = rating >= 4 of the right events.
    cfg = LoaderConfig(batch_size=64, max_seq_len=40, mode="ranking", num_candidates=4)
    tokens = 0
    for rank in range(2):
        for batch in make_loader(ml100k_prepared / "train", ML_FEATURES, cfg, rank=rank, world_size=2):
            cand_items = batch.candidates.to_dict()["item_id"]
            ratings = batch.candidates.to_dict()["action"].values()
            assert torch.equal(batch.labels_CL[:, 0], (ratings >= 4).float())
            assert torch.all(cand_items.lengths() == 4)  # every ML user has >= 20 ratings
            train_n = torch.tensor([len(by_user[u]) - 2 for u in batch.user_ids_B.tolist()])
            assert torch.equal(batch.history_lengths_B, train_n.clamp(max=40) - 4)
            tokens += batch.num_tokens
    assert tokens > 0


def test_convert_then_prepare_then_load_movielens(tmp_path):
    """The documented path end to end: data.convert -> prepare -> eval loader."""
    if not ML100K.is_file():
        pytest.skip("MovieLens-100K not available")
    from genrec.data.convert import convert

    convert("movielens", [str(ML100K)], tmp_path / "log", progress=False)
    features = FeatureSpec(sparse=["item_id", "action"], labels=[])
    manifest = prepare(tmp_path / "log", tmp_path / "prepared", features, SplitConfig(), progress=False)
    assert manifest["counts"]["users"] == 943 and manifest["counts"]["source_events"] == 100_000
    cfg = LoaderConfig(batch_size=128, max_seq_len=20, mode="eval", num_workers=2)
    ratings = Counter(np.loadtxt(ML100K, dtype=np.int64)[:, 0].tolist())
    users, tokens = set(), 0
    for batch in make_loader(tmp_path / "prepared" / "test", features, cfg):
        users.update(batch.user_ids_B.tolist())
        assert batch.labels_CL.shape == (batch.batch_size, 0)
        num_ratings = torch.tensor([ratings[u] for u in batch.user_ids_B.tolist()])
        assert torch.equal(batch.history_lengths_B, (num_ratings - 1).clamp(max=20))
        tokens += batch.num_tokens
    assert len(users) == 943 and tokens == sum(min(n - 1, 20) for n in ratings.values())


def test_random_window_end_makes_every_event_a_candidate_in_order(ad_prepared):
    """With random_end_prob = 1 a row's window ends at a drawn event: history and candidates
    stay a contiguous, time-ordered slice of the user's sequence ending there, and over the
    epochs candidates come from all over the sequence, not only from its end."""
    rows = split_rows(ad_prepared / "train")
    C = 2
    cfg = LoaderConfig(batch_size=16, max_seq_len=6, mode="ranking", num_candidates=C, random_end_prob=1.0)
    loader = make_loader(ad_prepared / "train", AD_FEATURES, cfg)
    offsets_from_end = Counter()
    for _ in range(4):  # epochs
        for batch in loader:
            hists = per_user(batch, "history", batch.history_lengths_B)
            cand_lengths_B = batch.candidates.lengths()[: batch.batch_size]
            cands = per_user(batch, "candidates", cand_lengths_B)
            labels = torch.split(batch.labels_CL, cand_lengths_B.tolist())
            for b, user in enumerate(batch.user_ids_B.tolist()):
                items = rows[user][AD_FEATURES.item]
                window = hists[b][AD_FEATURES.item] + cands[b][AD_FEATURES.item]
                n = len(window)
                starts = [s for s in range(len(items) - n + 1) if items[s:s + n] == window]
                assert starts, (user, window)
                end = starts[-1] + n
                assert end >= 2
                offsets_from_end[len(items) - end] += 1
                clicks = rows[user]["click"][end - len(cands[b][AD_FEATURES.item]):end]
                assert labels[b][:, AD_FEATURES.labels.index("click")].tolist() == clicks
    assert offsets_from_end[0] < sum(offsets_from_end.values()) / 2  # most windows end before the last event
    assert len(offsets_from_end) > 10
    with pytest.raises(ValueError, match="random_end_prob"):
        make_loader(ad_prepared / "train", AD_FEATURES, replace(cfg, random_end_prob=1.5))


@pytest.mark.parametrize("first", [1, 37, 100, 10_000])
def test_the_first_rows_of_a_split_are_the_same_users_on_any_world_size(ad_prepared, first):
    """Capped validation scores the split's first `first` users: each rank counts the
    first `rows_in_first` rows of its stream, and together they are the one-rank loader's
    first rows, whatever the world size (also where few row groups are cut into slices)."""
    cfg = LoaderConfig(batch_size=16, max_seq_len=9, mode="eval", shuffle=False, drop_last=False,
                       equal_batches_per_rank=False)  # as models/build.py's eval_loader

    def stream(rank, world):
        loader = make_loader(ad_prepared / "valid", AD_FEATURES, cfg, rank=rank, world_size=world)
        return [u for b in loader for u in b.user_ids_B.tolist()], loader.rows_in_first(first)

    users, n = stream(0, 1)
    assert n == min(first, len(users))
    for world in (2, 3, 4, 7):
        parts = [stream(r, world) for r in range(world)]
        counted = [u for rank_users, share in parts for u in rank_users[:share]]
        assert sum(share for _, share in parts) == n
        assert sorted(counted) == sorted(users[:n]), world
    with pytest.raises(ValueError, match="shuffle = false"):
        make_loader(ad_prepared / "valid", AD_FEATURES, replace(cfg, shuffle=True)).rows_in_first(first)


def test_worker_processes_leave_the_global_torch_rng_alone(ad_prepared):
    """Training draws its negatives from torch's global RNG: a loader with worker processes
    that took a draw from it at each epoch's start (and again at a resume) would make a
    resumed run train other than the run that went on."""
    loader = make_loader(ad_prepared / "train", AD_FEATURES, LoaderConfig(batch_size=64, max_seq_len=8, num_workers=2))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert len(list(loader)) > 0
    assert torch.equal(torch.get_rng_state(), before)
