"""Tables larger than memory: a loaded artifact keeps its embedding tables memory-mapped
(file-backed pages, read in on lookup, one page per row), never copied into the process's
own memory, and answers the same as before; a bounded cache of hot rows answers exactly as
the table does; a truncated table file is refused at load, by name."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from genrec.models.serving.artifact import ServingTable, TablePatch, export_artifact, quantize_rows
from genrec.models.serving.bench import build_synthetic_model, synthetic_request
from genrec.models.serving.mapped import RowCache, disk_read_bytes, evict
from genrec.models.serving.ranker import ServingConfig, load_artifact

NUM_ITEMS = 200_000
DIM = 64


def _rss_mb() -> dict[str, float]:
    """RssAnon (the process's own memory) and RssFile (mapped file pages) in MB."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssFile")}


def _evict_tables(art, ranker, names=None) -> None:
    tables = [t for name, t in ranker.contents.tables.items() if names is None or name in names]
    evict(art / "tables", *(x for t in tables for x in (t.ids_N, t.rows_ND, t.scale_bias_N2)))


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
    evict(art)
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
    # Cold again: the same answer read back from the disk, a page or so per row read (no
    # readahead over the table: without the random-access advice this read 10-50 MB).
    _evict_tables(art, ranker)
    read0 = disk_read_bytes()
    assert ranker.rank(req) == first
    read = disk_read_bytes() - read0
    rows_read = 60 + 50  # history + candidates
    assert 0 < read < rows_read * 4 * 4096, read


def test_evict_refuses_memory_that_is_not_a_mapped_file(tmp_path):
    t = torch.arange(1 << 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="not a mapping of a file"):
        evict(tmp_path, t)
    assert bool((t == torch.arange(1 << 16, dtype=torch.float32)).all())  # untouched


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_cached_table_answers_as_the_table_does(dtype):
    """Property: whatever the order of lookups, slot collisions (4 slots for 500 rows),
    unknown ids and live-delta patches, a table with a hot-row cache returns exactly the
    rows of the same table without one; concurrent lookups too."""
    gen = torch.Generator().manual_seed(0)
    n, d = 500, 8
    rows, sb = quantize_rows(torch.randn(n, d, generator=gen), dtype)
    ids = torch.arange(n) * 7 + 3
    patch = TablePatch(ids_N=ids[::50].clone(), live_N=torch.arange(10) % 3 != 0, rows_ND=rows[:10].clone(),
                       scale_bias_N2=None if sb is None else sb[:10].clone())
    plain = ServingTable(ids_N=ids, rows_ND=rows, scale_bias_N2=sb, patch=patch)
    cache = RowCache(n, d, 4 * (4 * d + 8))
    assert cache.capacity == 4
    cached = ServingTable(ids_N=ids, rows_ND=rows, scale_bias_N2=sb, patch=patch, cache=cache)
    for _ in range(50):
        # Hot ids (a few rows read often), duplicates in one lookup, ids never trained.
        q = torch.cat([ids[torch.randint(0, 6, (20,), generator=gen)], ids[torch.randint(0, n, (20,), generator=gen)],
                       torch.randint(0, 7 * n, (10,), generator=gen)])
        assert torch.equal(cached.lookup(q), plain.lookup(q))
    assert cache.hits > 0 and cache.misses > 0
    queries = [ids[torch.randint(0, n, (64,), generator=gen)] for _ in range(200)]
    wrong = []

    def hammer(part):
        wrong.extend(i for i, q in enumerate(part) if not torch.equal(cached.lookup(q), plain.lookup(q)))

    workers = [threading.Thread(target=hammer, args=(queries[i::2],)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert wrong == []


def test_a_ranker_with_a_row_cache_ranks_as_without_one_within_its_bound(artifact):
    art, feats = artifact
    bound_mb = 8
    plain = load_artifact(art, ServingConfig(max_k=50, table_cache_mb=0))
    before = _rss_mb()
    cached = load_artifact(art, ServingConfig(max_k=50, table_cache_mb=bound_mb))
    assert plain.table_cache_stats() == {}
    reqs = [synthetic_request(NUM_ITEMS, 60, k=50, n=10, seed=s, item_features=feats) for s in range(4)]
    for req in reqs + reqs:  # the second round reads its rows from the cache
        assert cached.rank(req) == plain.rank(req)
    stats = cached.table_cache_stats()["t_item_id"]
    assert stats["hits"] >= 0.9 * 4 * (60 + 50) and stats["bytes"] <= bound_mb * 2**20
    # A cold item table: only rows that missed the cache are read from the disk (their
    # positions are known from the item index; slots shared by two of a request's rows miss).
    expected = plain.rank(reqs[0])
    _evict_tables(art, cached, ["t_item_id"])
    read0, misses0 = disk_read_bytes(), cached.table_cache_stats()["t_item_id"]["misses"]
    assert cached.rank(reqs[0]) == expected
    missed = cached.table_cache_stats()["t_item_id"]["misses"] - misses0
    assert missed < 10 and disk_read_bytes() - read0 <= missed * 4 * 4096
    assert _rss_mb()["RssAnon"] - before["RssAnon"] < bound_mb + 8


def test_a_cache_serves_where_the_stores_kernels_cannot_load(artifact, monkeypatch, caplog):
    """Read-ahead of a cache's misses goes through the store's native library; on a CPU it
    was not built for (simulated: no AVX2 / FMA reported) the server answers the same, once
    warned, instead of failing every request."""
    from genrec.models.serving import mapped
    from genrec.sparse import native

    art, feats = artifact
    reqs = [synthetic_request(NUM_ITEMS, 60, k=50, n=10, seed=s, item_features=feats) for s in range(2)]
    expected = [load_artifact(art, ServingConfig(max_k=50, table_cache_mb=0)).rank(r) for r in reqs]
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_cpu_flags", lambda: set())
    monkeypatch.setattr(mapped, "_read_ahead", True)
    if not native.ISA_FLAGS.get(__import__("platform").machine()):
        pytest.skip("the store's kernels need no CPU feature on this architecture")
    cached = load_artifact(art, ServingConfig(max_k=50, table_cache_mb=1))
    assert [cached.rank(r) for r in reqs] == expected
    assert cached.table_cache_stats()["t_item_id"]["misses"] > 0
    assert sum("without read-ahead" in r.getMessage() for r in caplog.records) == 1


def test_a_truncated_table_file_is_refused_naming_it(artifact, tmp_path):
    art, _ = artifact
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    path = bad / "tables" / "t_item_id.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    with pytest.raises(ValueError, match="tables/t_item_id.safetensors"):
        load_artifact(bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_cache_bound_that_is_not_a_finite_size_is_refused_naming_the_key(artifact, bad):
    with pytest.raises(ValueError, match="table_cache_mb"):
        load_artifact(artifact[0], ServingConfig(max_k=50, table_cache_mb=bad))
