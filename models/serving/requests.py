"""Ranking requests from a prepared split: each user's history minus its last event (the
event a request would be made for), as `Ranker.rank` takes it."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from genrec.data.config import FeatureSpec


def split_requests(data: str | Path, features: FeatureSpec, n: int, split: str = "test") -> list[dict]:
    """Requests for the first `n` users of `data`/`split` that have two or more events."""
    out: list[dict] = []
    for part in sorted((Path(data) / split).glob("*.parquet")):
        for row in pq.read_table(part).to_pylist():
            if len(out) == n:
                return out
            if len(row[features.item]) < 2:
                continue
            out.append({
                "item_ids": row[features.item][:-1], "actions": row[features.action][:-1],
                "timestamps": row[features.timestamp][:-1],
                "features": {f: row[f][:-1] for f in features.sparse if f not in (features.item, features.action)},
            })
    return out
