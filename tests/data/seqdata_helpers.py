"""Helpers of the prepare / loader tests: tiny event logs written with pyarrow, MovieLens-100K."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from genrec.data.config import FeatureSpec

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
