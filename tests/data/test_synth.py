"""The synthetic ad log: shape, determinism, streaming layout, planted signal, bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.data.synth import COLUMNS, MANIFEST_NAME, SynthConfig, click_auc, synthesize

USERS, ITEMS, EVENTS = 600, 3000, 60_000


def _read(out: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("part-*.parquet")))


def _auc_pairwise(scores: np.ndarray, labels: np.ndarray) -> float:
    """Independent AUC: P(score_pos > score_neg) + 0.5 P(tie), by brute-force pair counting."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> tuple[Path, dict, pa.Table]:
    out = tmp_path_factory.mktemp("synth") / "log"
    summary = synthesize(out, num_users=USERS, num_items=ITEMS, num_events=EVENTS, seed=11,
                         events_per_file=20_000, emit_truth=True, progress=False)
    return out, summary, _read(out)


def test_counts_schema_and_manifest(log):
    out, summary, table = log
    assert table.num_rows == EVENTS == summary["num_events"]
    assert table.column_names == COLUMNS + ["p_click", "p_click_static"]
    for name in COLUMNS:
        expected = pa.int8() if name in ("click", "conversion") else pa.int64()
        assert table.schema.field(name).type == expected, name
    assert pc_unique(table, "user_id") == USERS  # every user has >= 1 event
    assert 1 <= pc_unique(table, "item_id") <= ITEMS
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["complete"] and manifest["files"] == sorted(p.name for p in out.glob("part-*.parquet"))
    assert len(manifest["files"]) >= 3  # ~20k events per file
    # No staging folders left beside the output.
    assert [p.name for p in out.parent.iterdir()] == ["log"]


def pc_unique(table: pa.Table, name: str) -> int:
    return int(np.unique(table.column(name).to_numpy()).size)


def test_labels_actions_and_hierarchy_are_consistent(log):
    _, _, t = log
    click = t.column("click").to_numpy()
    conv = t.column("conversion").to_numpy()
    action = t.column("action").to_numpy()
    assert set(np.unique(click)) <= {0, 1} and set(np.unique(conv)) <= {0, 1}
    assert (conv <= click).all(), "a conversion without a click"
    np.testing.assert_array_equal(action, np.where(conv == 1, 2, np.where(click == 1, 1, 0)))
    assert 0.01 < click.mean() < 0.2
    # item -> campaign -> advertiser -> category is a function at every level.
    for child, parent in (("item_id", "campaign_id"), ("campaign_id", "advertiser_id"),
                          ("advertiser_id", "category_id")):
        pairs = np.unique(np.stack([t.column(child).to_numpy(), t.column(parent).to_numpy()]), axis=1)
        assert np.unique(pairs[0]).size == pairs.shape[1], f"{child} maps to several {parent}"


def test_each_part_holds_whole_users_in_time_order(log):
    out, _, _ = log
    seen: set[int] = set()
    for path in sorted(out.glob("part-*.parquet")):
        t = pq.read_table(path)
        ts = t.column("ts").to_numpy()
        assert (np.diff(ts) >= 0).all(), f"{path.name} not in time order"
        users = set(np.unique(t.column("user_id").to_numpy()).tolist())
        assert not users & seen, "a user is split across part-files"
        seen |= users


def test_popularity_is_heavy_tailed(log):
    _, _, t = log
    counts = np.sort(np.bincount(np.unique(t.column("item_id").to_numpy(), return_inverse=True)[1]))[::-1]
    top = counts[: max(1, counts.size // 100)].sum() / counts.sum()
    assert top > 0.1, f"top 1% of ads get only {top:.1%} of impressions"


def test_planted_signal_oracle_beats_popularity(log):
    out, summary, t = log
    click = t.column("click").to_numpy()
    p_click = t.column("p_click").to_numpy()
    items = t.column("item_id").to_numpy()
    # Popularity baseline: each ad's CTR over the whole log (in-sample, to its advantage).
    _, inverse = np.unique(items, return_inverse=True)
    item_ctr = np.bincount(inverse, weights=click) / np.bincount(inverse)
    rng = np.random.default_rng(0)
    sample = rng.choice(click.size, 6000, replace=False)
    oracle_auc = _auc_pairwise(p_click[sample], click[sample])
    pop_auc = _auc_pairwise(item_ctr[inverse][sample], click[sample])
    assert oracle_auc > pop_auc + 0.05, (oracle_auc, pop_auc)
    # The manifest's figures agree in direction and the rank-based AUC matches brute force.
    truth = summary["truth"]
    assert truth["oracle_click_auc"] > truth["oracle_static_click_auc"] > truth["item_ctr_click_auc"]
    assert click_auc(p_click[sample], click[sample]) == pytest.approx(oracle_auc, abs=1e-9)
    assert click_auc(item_ctr[inverse][sample], click[sample]) == pytest.approx(pop_auc, abs=1e-9)


def test_sequential_signal_is_visible_in_the_log(log):
    """Without the truth columns: after a click, an ad of the clicked category is clicked far
    more often than other ads, and shows up more often than chance."""
    _, _, t = log
    order = np.lexsort((t.column("ts").to_numpy(), t.column("user_id").to_numpy()))
    user = t.column("user_id").to_numpy()[order]
    cat = t.column("category_id").to_numpy()[order]
    click = t.column("click").to_numpy()[order]
    same, other = [], []
    for u0, u1 in zip(*_user_spans(user)):
        last = None
        for i in range(u0, u1):
            if last is not None:
                (same if cat[i] == last else other).append(click[i])
            if click[i]:
                last = cat[i]
    assert np.mean(same) > 2 * np.mean(other), (np.mean(same), np.mean(other))
    share = len(same) / (len(same) + len(other))
    chance = (np.bincount(cat) / cat.size) ** 2
    assert share > 2 * chance.sum()


def _user_spans(user_sorted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    starts = np.r_[0, np.flatnonzero(np.diff(user_sorted)) + 1]
    return starts, np.r_[starts[1:], user_sorted.size]


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    kw = dict(num_users=50, num_items=200, num_events=3000, events_per_file=1000, progress=False)
    a = synthesize(tmp_path / "a", seed=5, **kw)
    b = synthesize(tmp_path / "b", seed=5, **kw)
    c = synthesize(tmp_path / "c", seed=6, **kw)
    assert a["files"] == b["files"]
    for name in a["files"] + [MANIFEST_NAME]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / a["files"][0]).read_bytes() != (tmp_path / "c" / c["files"][0]).read_bytes()


def test_sparse_ids_are_large_and_consistent(tmp_path):
    synthesize(tmp_path / "s", num_users=20, num_items=100, num_events=500, seed=1, progress=False,
               config=SynthConfig(sparse_ids=True))
    t = _read(tmp_path / "s")
    assert t.column("item_id").to_numpy().max() > 1 << 40
    assert t.column("user_id").to_numpy().min() > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_users=0), r"num_users \(--users\) must be a positive integer"),
    (dict(num_items=-3), r"num_items \(--items\) must be a positive integer"),
    (dict(num_events=0), r"num_events \(--events\) must be a positive integer"),
    (dict(num_events=5), r"num_events \(5\) must be >= num_users"),
    (dict(num_events=10**19), r"num_events \(--events\) must be at most 2\*\*62"),  # was an OverflowError
    (dict(num_items=10**15), r"not enough memory for --users 10 --items 1,000,000,000,000,000"),  # was a MemoryError
    # Two users of 5e14 events each: one part-file apiece, found in O(users) (a list of the 1e9
    # multiples of events_per_file took 8 GB first).
    (dict(num_users=2, num_events=10**15), "not enough memory for --users 2 "),
    (dict(events_per_file=0), "events_per_file"),
    (dict(seed=-1), "seed"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    args = dict(num_users=10, num_items=10, num_events=100, seed=0, progress=False) | kwargs
    with pytest.raises(ValueError, match=match):
        synthesize(tmp_path / "out", **args)
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    kw = dict(num_users=5, num_items=10, num_events=50, seed=0, progress=False)
    with pytest.raises(ValueError, match="not empty"):
        synthesize(out, **kw)
    assert (out / "keep.txt").exists()
    # --overwrite replaces only a synth output: a foreign folder is refused and kept.
    with pytest.raises(ValueError, match="refusing to replace"):
        synthesize(out, overwrite=True, **kw)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    (out / "keep.txt").unlink()
    synthesize(out, **kw)
    # A synth output with a file of the user's in it: replacing the folder would delete it.
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"does not list \(notes.txt\)"):
        synthesize(out, overwrite=True, **kw)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    synthesize(out, overwrite=True, **kw)
    assert (out / MANIFEST_NAME).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # An existing empty folder is fine without overwrite.
    empty = tmp_path / "empty"
    empty.mkdir()
    synthesize(empty, **kw)
    assert (empty / MANIFEST_NAME).exists()


def test_truth_sample_size_is_checked_and_a_log_without_clicks_writes_strict_json(tmp_path):
    kw = dict(num_users=20, num_items=30, num_events=200, seed=0, progress=False)
    with pytest.raises(ValueError, match="truth_sample_size must be >= 1, got 0"):
        synthesize(tmp_path / "a", config=SynthConfig(truth_sample_size=0), **kw)
    assert not (tmp_path / "a").exists()
    quiet = SynthConfig(base_ctr=1e-9, same_category_boost=0, same_advertiser_boost=0, last_click_similarity=0)
    out = synthesize(tmp_path / "b", config=quiet, **kw)
    assert out["ctr"] == 0.0 and out["truth"]["oracle_click_auc"] is None  # no AUC without a click
    text = (tmp_path / "b" / MANIFEST_NAME).read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
