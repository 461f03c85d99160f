"""Fixtures of the data tests: tiny event logs written with pyarrow, and MovieLens-100K."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.data.config import FeatureSpec
from genrec.data.prepare import SplitConfig, prepare

ML100K = Path("/work/shared/data/ml-100k/u.data")
AD_FEATURES = FeatureSpec(sparse=["item_id", "action", "advertiser_id"], labels=["click", "conversion"])
ML_FEATURES = FeatureSpec(sparse=["item_id", "action"], labels=["click"])


def random_log(num_users: int, num_events: int, seed: int = 0, *, num_items: int = 500) -> pa.Table:
    """An ad-style log in random row order, with distinct ts per user (so order is unambiguous)."""
    rng = np.random.default_rng(seed)
    user = rng.integers(0, num_users, num_events) * 7 + 3
    ts = rng.permutation(num_events).astype(np.int64) + 1_000_000
    item = rng.integers(0, num_items, num_events)
    click = (rng.random(num_events) < 0.3).astype(np.int8)
    conversion = (click & (rng.random(num_events) < 0.3)).astype(np.int8)
    return pa.table({
        "user_id": user, "ts": ts, "item_id": item, "action": click.astype(np.int64) + conversion,
        "advertiser_id": item // 10, "click": click, "conversion": conversion,
    })


def write_log(table: pa.Table, directory: Path, num_files: int = 1, row_group_size: int = 1000) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    bounds = np.linspace(0, table.num_rows, num_files + 1).astype(int)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        path = directory / f"log-{i:03d}.parquet"
        pq.write_table(table.slice(a, b - a), path, row_group_size=row_group_size)
        paths.append(path)
    return paths


def ml100k_log() -> pa.Table:
    raw = np.loadtxt(ML100K, dtype=np.int64)
    rating = raw[:, 2]
    return pa.table({
        "user_id": raw[:, 0], "item_id": raw[:, 1], "action": rating, "ts": raw[:, 3],
        "click": (rating >= 4).astype(np.int8),
    })


@pytest.fixture(scope="session")
def ml100k_prepared(tmp_path_factory) -> Path:
    if not ML100K.is_file():
        pytest.skip("MovieLens-100K not available")
    base = tmp_path_factory.mktemp("ml100k")
    write_log(ml100k_log(), base / "log", num_files=2, row_group_size=20_000)
    out = base / "prepared"
    prepare(base / "log", out, ML_FEATURES, SplitConfig(), num_shards=2, row_group_users=64, progress=False)
    return out


@pytest.fixture(scope="session")
def ad_prepared(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("ads")
    write_log(random_log(300, 12_000, seed=1), base / "log", num_files=3)
    out = base / "prepared"
    prepare(base / "log", out, AD_FEATURES, SplitConfig(), num_shards=3, row_group_users=16, progress=False)
    return out
