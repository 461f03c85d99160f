"""Tables larger than memory: a loaded artifact keeps its embedding tables memory-mapped
(file-backed pages, read in on lookup), never copied into the process's own memory, and
answers the same as before; a truncated table file is refused at load, by name."""

from __future__ import annotations

import shutil

import pytest

from genrec.models.serving.artifact import export_artifact
from genrec.models.serving.bench import build_synthetic_model, drop_page_cache, synthetic_request
from genrec.models.serving.ranker import ServingConfig, load_artifact

NUM_ITEMS = 200_000
DIM = 64


def _rss_mb() -> dict[str, float]:
    """RssAnon (the process's own memory) and RssFile (mapped file pages) in MB."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssFile")}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=DIM, max_seq_len=64, seed=2)
    art = export_artifact(model, {}, tmp_path_factory.mktemp("mapped") / "a", dtype="fp32", item_ids=item_ids,
                          item_features=feats, version="v", export_program=False, retrieval_index="exact")
    return art, feats


def test_tables_stay_mapped_and_answer_from_disk(artifact):
    art, feats = artifact
    table_mb = (art / "tables" / "t_item_id.safetensors").stat().st_size / 2**20
    assert table_mb > 40
    drop_page_cache(art)
    before = _rss_mb()
    ranker = load_artifact(art, ServingConfig(max_k=50))
    loaded = _rss_mb()
    req = synthetic_request(NUM_ITEMS, 60, k=50, n=10, seed=1, item_features=feats)
    first = ranker.rank(req)
    after = _rss_mb()
    # Loading and answering add far less private memory than one table holds (the item
    # table, the item index and the checksums' reads are all file pages).
    assert loaded["RssAnon"] - before["RssAnon"] < 0.25 * table_mb
    assert after["RssAnon"] - before["RssAnon"] < 0.25 * table_mb
    table = ranker.table_of["item_id"]
    assert table.rows_ND.untyped_storage().nbytes() >= NUM_ITEMS * DIM * 4
    # Cold again: the same answer read back from the files.
    drop_page_cache(art)
    assert ranker.rank(req) == first


def test_a_truncated_table_file_is_refused_naming_it(artifact, tmp_path):
    art, _ = artifact
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    path = bad / "tables" / "t_item_id.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    with pytest.raises(ValueError, match="tables/t_item_id.safetensors"):
        load_artifact(bad)
