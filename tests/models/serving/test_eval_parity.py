"""A prepared test split replayed through `genrec serve` on loopback gives `genrec eval`'s
retrieval figures in every history-length slice: the same rows, the whole history sent,
`exclude_seen` filtering all of it (not only the events the model reads)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from genrec.data.prepare import prepare
from genrec.data.synth import synthesize
from serving_helpers import ServerProcess
from train_helpers import tiny_config

WINDOW = 12
"""data.loader.max_seq_len of the run, and the server's --max-history: most test histories
are longer, so the model reads only part of what the request sends."""


def _log_without_repeats(logs: Path, out: Path) -> None:
    """The log with each user's repeated items dropped (first sighting kept). Evaluation ranks
    a target even when the user saw it before, which serving with exclude_seen never returns,
    so parity holds only for targets that are new to the user."""
    table = ds.dataset(sorted(logs.glob("*.parquet")), format="parquet").to_table()
    table = table.sort_by([("user_id", "ascending"), ("ts", "ascending")])
    users, items = table.column("user_id").to_pylist(), table.column("item_id").to_pylist()
    seen, keep = set(), []
    for i, key in enumerate(zip(users, items)):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    out.mkdir(parents=True)
    pq.write_table(table.take(pa.array(keep)), out / "part-00000.parquet")


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    from genrec.models.serving.export import export_checkpoint
    from genrec.models.train.trainer import run_training

    root = tmp_path_factory.mktemp("parity")
    synthesize(root / "logs", num_users=60, num_items=150, num_events=3000, seed=11, progress=False)
    _log_without_repeats(root / "logs", root / "unique")
    cfg = tiny_config(root / "data", root / "run", max_steps=12, checkpoint_every=12, best_metric=None)
    cfg.data.loader.max_seq_len = WINDOW
    prepare(root / "unique", root / "data", cfg.data.features, cfg.data.prepare.split, num_shards=2,
            row_group_users=16, progress=False)
    run_training(cfg)
    artifact = export_checkpoint(root / "run", root / "artifact", dtype="fp32")
    return root / "data", artifact


def test_replayed_split_gives_eval_figures_per_history_length(served_run, tmp_path):
    from genrec.models.evaluation.evaluate import HISTORY_EDGES, run_evaluation
    from genrec.models.evaluation.slices import length_buckets

    data, artifact = served_run
    run_evaluation(artifact, data, "test", out_dir=tmp_path / "eval", progress=False, num_resamples=10)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())

    rows = pq.read_table(data / "test").to_pylist()
    hits, gains, truncated = defaultdict(list), defaultdict(list), 0
    server = ServerProcess(artifact, extra=["--max-history", str(WINDOW)])
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for row in rows:
                n = len(row["item_id"]) - 1  # the last event is the held-out target
                body = {"item_ids": row["item_id"][:n], "actions": row["action"][:n], "timestamps": row["ts"][:n],
                        "features": {f: row[f][:n] for f in ("advertiser_id", "category_id")},
                        "request_time": row["ts"][n], "k": 10, "n": 10, "exclude_seen": True,
                        "sort_by": "retrieval"}
                r = client.post("/v1/rank", json=body)
                assert r.status_code == 200, r.text
                answer = r.json()
                truncated += answer["history_truncated"]
                returned = [x["item_id"] for x in answer["items"]]
                assert not set(returned) & set(body["item_ids"])  # nothing of the whole history
                bucket = str(length_buckets([n], HISTORY_EDGES)[0])
                rank = returned.index(row["item_id"][n]) if row["item_id"][n] in returned else None
                for key in (bucket, "all"):
                    hits[key].append(0.0 if rank is None else 1.0)
                    gains[key].append(0.0 if rank is None else 1.0 / math.log2(rank + 2))
    finally:
        server.close()
    assert truncated > len(rows) // 2, "most histories must be longer than what the model reads"
    assert len(hits) > 2, "the split must span several history-length slices"
    for bucket in hits:
        prefix = "retrieval." if bucket == "all" else f"slices.retrieval.history_length.{bucket}."
        assert report[prefix + "count"] == len(hits[bucket]), bucket
        assert sum(hits[bucket]) / len(hits[bucket]) == pytest.approx(report[prefix + "hr@10"], abs=1e-9), bucket
        assert sum(gains[bucket]) / len(gains[bucket]) == pytest.approx(report[prefix + "ndcg@10"], abs=1e-6), bucket
