"""Serving benchmark: `genrec bench serve [--quick]` -> `run(quick) -> dict`.

What it measures (all side by side in one run, since the machine is shared and noisy):

- p50 / p99 latency and QPS of POST /v1/rank against a real server in a second process on
  loopback (SERVER_WORKERS batch workers of one thread each; history 1,024 events, 1M-item
  corpus, K=500, N=50; quick: 20K items, 128 events,
  K=100, N=20). Latency is single stream (one request in flight); QPS uses several client threads so
  the server's dynamic batching has something to batch. Each is the median of HTTP_ROUNDS
  rounds against the same server (`*_spread`: median / min / max), since one round's p99 is
  its third-slowest request of 200 (nearest rank) and moved by 1-2 ms between runs. The headline keys serve the int8
  artifact (what the README exports: its item index is scanned by the native int8 scan);
  fp32_p50_ms, fp32_p99_ms and fp32_qps the fp32 artifact of the same model.
- M-FALCON (history encoded once, candidates scored in micro-batches against the KV cache) vs
  scoring each candidate by a full forward over history + candidate, in process.
- int8 vs fp32 artifact: in-process latency of `rank`, bytes held, and the quality change:
  ranking AUC against labels drawn from the fp32 model's own probabilities, and retrieval
  NDCG@N of the int8 top-N against the fp32 top-N as ground truth (the model is synthetic,
  untrained; a trained checkpoint gives the production figure).

- Live deltas: the time to build and swap in the base plus a delta of 1% of the item rows.
- Tables read from disk: in-process latency (and MB read from the disk) with the tables'
  pages dropped before each request, without and with a hot-row cache.
- The approximate index (models/serving/ann.py) on clustered vectors (10M; quick: 200K):
  build time, recall@500 of the calibrated search against exact search, one query's p99.
  Building the 10M index takes minutes: `GENREC_BENCH_SERVE_ANN=0` leaves this part out
  (its keys absent, `ann_skipped: true`) to re-measure the serving path alone.

Targets: p99 < 25 ms single stream; 100 QPS at 4 clients; M-FALCON >= 10x recompute at K=500;
delta_apply_s < 1; recall@500 >= 0.95 with the search's p99 < 30 ms at 10M items.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from genrec.data.config import FeatureSpec
from genrec.dense.config import TowerConfig
from genrec.dense.tower import build_tower
from genrec.models.model import GenerativeRecommender, ModelConfig


def _log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def build_synthetic_model(*, num_items: int, dim: int = 32, max_seq_len: int = 256, num_layers: int = 2,
                          num_advertisers: int = 50, num_categories: int = 20, seed: int = 0,
                          token_combine: str = "sum", kind: str = "hstu", ranking_head_input: str = "state",
                          similarity: str = "cosine"):
    """A randomly initialized ranking + retrieval model over a torchrec EmbeddingCollection.

    Returns (model, item_ids, item_features): item ids are 0..num_items-1, each with an
    advertiser and a category (the candidate side features)."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    torch.manual_seed(seed)
    spec = FeatureSpec(sparse=["item_id", "action", "advertiser_id", "category_id"], labels=["click", "conversion"])
    sizes = {"item_id": num_items, "action": 4, "advertiser_id": num_advertisers, "category_id": num_categories}
    class AnyKeysEmbeddingCollection(EmbeddingCollection):
        """EmbeddingCollection that accepts a KJT with a subset of its features (the model
        looks up candidates without the action, and items alone)."""

        def forward(self, kjt: KeyedJaggedTensor):
            present = set(kjt.keys())
            names = [f for group in self._feature_names for f in group]
            missing = [f for f in names if f not in present]
            if missing:
                b = kjt.stride()
                jts = {k: kjt[k] for k in kjt.keys()}
                empty = JaggedTensor(values=torch.zeros(0, dtype=kjt.values().dtype),
                                     lengths=torch.zeros(b, dtype=torch.int32))
                jts.update({f: empty for f in missing})
                kjt = KeyedJaggedTensor.from_jt_dict({f: jts[f] for f in names})
            out = super().forward(kjt)
            return {k: v for k, v in out.items() if k in present}

    ec = AnyKeysEmbeddingCollection(tables=[
        EmbeddingConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=n, feature_names=[f]) for f, n in sizes.items()
    ])
    with torch.no_grad():
        for t in ec.embeddings.values():
            t.weight.normal_(0, 0.1)
    tower = build_tower(TowerConfig(kind=kind, embedding_dim=dim, num_layers=num_layers, num_heads=2,
                                    attention_dim=dim // 2, linear_dim=dim // 2, max_seq_len=max_seq_len,
                                    dropout=0.0))
    model = GenerativeRecommender(features=spec, cfg=ModelConfig(ranking=True, retrieval=True, token_combine=token_combine,
                                                                      ranking_head_input=ranking_head_input,
                                                                      similarity=similarity),
                                  embeddings=ec, feature_dims={f: dim for f in sizes}, tower=tower, dim=dim)
    with torch.no_grad():  # spread the untrained probabilities over (0, 1), not all near 0.5
        model.task_heads[-1].weight.normal_(0, 2.0)
    model.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    item_ids = torch.arange(num_items)
    item_features = {"advertiser_id": torch.randint(num_advertisers, (num_items,), generator=gen),
                     "category_id": torch.randint(num_categories, (num_items,), generator=gen)}
    return model, item_ids, item_features


def synthetic_request(num_items: int, history: int, *, k: int, n: int, seed: int, item_features=None) -> dict:
    gen = torch.Generator().manual_seed(seed)
    items = torch.randint(num_items, (history,), generator=gen)
    req = {"item_ids": items.tolist(), "actions": torch.randint(3, (history,), generator=gen).tolist(),
           "timestamps": (1_700_000_000 + torch.arange(history) * 37).tolist(), "k": k, "n": n}
    if item_features is not None:
        req["features"] = {f: col[items].tolist() for f, col in item_features.items()}
    return req


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(artifact: Path, port: int, *, threads: int = 2, timeout_s: float = 120.0,
                         extra: list[str] | None = None) -> subprocess.Popen:
    """`genrec serve` on loopback (in a child process); returns once /healthz answers."""
    import httpx

    cmd = [sys.executable, "-m", "genrec.scripts.cli", "serve", "--artifact", str(artifact), "--host", "127.0.0.1",
           "--port", str(port), "--threads", str(threads)] + (extra or [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not become healthy within {timeout_s}s")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    order = torch.argsort(scores)
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _ndcg(pred: list[int], truth: list[int]) -> float:
    rel = set(truth)
    dcg = sum(1.0 / torch.log2(torch.tensor(i + 2.0)).item() for i, x in enumerate(pred) if x in rel)
    idcg = sum(1.0 / torch.log2(torch.tensor(i + 2.0)).item() for i in range(min(len(truth), len(pred))))
    return dcg / idcg if idcg else 0.0


def quantization_quality(fp32, int8, requests: list[dict], seed: int = 0) -> dict:
    """Ranking AUC (labels drawn from the fp32 probabilities) and retrieval NDCG@N of the int8
    top-N against the fp32 top-N, over the same retrieved candidates."""
    gen = torch.Generator().manual_seed(seed)
    p32, p8, ndcgs, max_diff = [], [], [], 0.0
    for req in requests:
        a = fp32.rank(dict(req, sort_by="retrieval"))
        b = int8.rank(dict(req, sort_by="retrieval"))
        ndcgs.append(_ndcg([x["item_id"] for x in b["items"]], [x["item_id"] for x in a["items"]]))
        by_id = {x["item_id"]: x for x in b["items"]}
        for x in a["items"]:
            if x["item_id"] in by_id:
                task = fp32.tasks[0]
                p32.append(x["probabilities"][task])
                p8.append(by_id[x["item_id"]]["probabilities"][task])
                max_diff = max(max_diff, abs(p32[-1] - p8[-1]))
    p32_t, p8_t = torch.tensor(p32, dtype=torch.float64), torch.tensor(p8, dtype=torch.float64)
    labels = torch.bernoulli(p32_t, generator=gen)
    auc32, auc8 = _auc(p32_t, labels), _auc(p8_t, labels)
    return {"auc_fp32": auc32, "auc_int8": auc8, "auc_change": auc8 - auc32,
            "retrieval_ndcg_int8_vs_fp32": sum(ndcgs) / len(ndcgs), "max_abs_prob_diff": max_diff,
            "num_scored": len(p32)}


def _time_calls(fn, n: int, budget_s: float) -> list[float]:
    times, start = [], time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
        if time.perf_counter() - start > budget_s:
            break
    return times


HTTP_ROUNDS = 3
"""Rounds of the single-stream latency and of the QPS run, per artifact."""

ANN_K = 500
"""K of the approximate-index figures, quick and full (the issue's recall@500)."""


def clustered_vectors(num: int, dim: int, *, per_cluster: int = 100, noise: float = 0.5, seed: int = 0) -> torch.Tensor:
    """Unit vectors in clusters of about `per_cluster` (a random center plus Gaussian noise):
    trained item embeddings group by topic, and uniform random vectors would have no
    neighbourhoods for an approximate index to find."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(max(1, num // per_cluster), dim, generator=g)
    out = torch.empty(num, dim)
    for s in range(0, num, 1 << 20):  # in chunks: the noise of 10M rows at once would double the peak
        e = min(num, s + (1 << 20))
        pick = torch.randint(0, centers.shape[0], (e - s,), generator=g)
        out[s:e] = torch.nn.functional.normalize(centers[pick] + noise * torch.randn(e - s, dim, generator=g), dim=1)
    return out


def bench_ann(num_items: int, dim: int, k: int, num_queries: int, repeats: int = 3) -> dict:
    """The approximate retrieval index (models/serving/ann.py) at `num_items` clustered
    vectors: build time, recall@k of its calibrated search against exact search on user-like
    queries (not the calibration ones), and the latency of one query's search, median /
    min / max over `repeats` passes of p50 and p99."""
    from genrec.models.serving import ann

    emb_ND = clustered_vectors(num_items, dim)
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        meta = ann.build_ivf(emb_ND, Path(root) / ann.ANN_FILE, k=k)
        build_s = time.perf_counter() - t0
        index_bytes = (Path(root) / ann.ANN_FILE).stat().st_size
        retriever = ann.IVFRetriever(Path(root) / ann.ANN_FILE, meta, num_items, dim)
        queries = ann.calibration_queries(emb_ND, num_queries, seed=1)
        exact = ann.exact_top_k(queries, emb_ND, k)
        found = torch.cat([retriever.search(queries[i : i + 1], k, [{}])[1] for i in range(num_queries)])
        p50s, p99s = [], []
        for _ in range(repeats):
            lat = [_timed_ms(lambda i=i: retriever.search(queries[i : i + 1], k, [{}])) for i in range(num_queries)]
            p50s.append(_percentile(lat, 50))
            p99s.append(_percentile(lat, 99))
    result = {"ann_num_items": num_items, "ann_kind": meta["kind"], "ann_nlist": meta["nlist"],
              "ann_nprobe": meta["nprobe"], "ann_build_s": build_s,
              f"recall_at_{k}_vs_exact": ann.recall_at_k(found, exact),
              "ann_retrieve_p50_ms": _percentile(p50s, 50), "ann_retrieve_p50_ms_spread": _spread(p50s),
              "ann_retrieve_p99_ms": _percentile(p99s, 50), "ann_retrieve_p99_ms_spread": _spread(p99s),
              "ann_index_bytes": index_bytes}
    return result


def _cold_tables(art: Path, scfg, num_items: int, history: int, k: int, n: int, item_features, quick: bool) -> dict:
    """`cold_disk_*`: in-process latency with the tables' pages unmapped and dropped from the
    page cache before each request (their bytes read from the disk: /proc/self/io), with
    Zipf(1.05) histories: without a hot-row cache, then with one of a quarter of the tables'
    bytes (models/serving/mapped.py), warmed by as many requests first."""
    from genrec.models.serving.mapped import disk_read_bytes, evict
    from genrec.models.serving.ranker import load_artifact

    # A copy no other ranker of this process maps (pages a process maps stay resident).
    art = Path(shutil.copytree(art, art.with_name(art.name + "-cold")))
    gen = torch.Generator().manual_seed(7)
    popular = torch.randperm(num_items, generator=gen)
    weights = torch.arange(1, num_items + 1, dtype=torch.float64) ** -1.05
    count = 10 if quick else 40
    reqs = [synthetic_request(num_items, history, k=k, n=n, seed=i, item_features=item_features)
            for i in range(2 * count)]
    for req in reqs:
        items = popular[torch.multinomial(weights, history, replacement=True, generator=gen)]
        req.update(item_ids=items.tolist(), features={f: col[items].tolist() for f, col in item_features.items()})
    table_mb = sum(f.stat().st_size for f in (art / "tables").iterdir()) / 2**20
    out = {}
    for key, cache_mb in (("cold_disk", 0.0), ("cold_disk_cached", table_mb / 4)):
        ranker = load_artifact(art, replace(scfg, table_cache_mb=cache_mb))
        mapped = [x for t in ranker.contents.tables.values() for x in (t.ids_N, t.rows_ND, t.scale_bias_N2)]
        for req in reqs[:count]:
            ranker.rank(req)
        ms, read = [], []
        for req in reqs[count:]:
            evict(art / "tables", *mapped)
            read0 = disk_read_bytes()
            ms.append(_timed_ms(lambda req=req: ranker.rank(req)))
            read.append((disk_read_bytes() - read0) / 2**20)
        out.update({f"{key}_p50_ms": _percentile(ms, 50), f"{key}_p99_ms": _percentile(ms, 99),
                    f"{key}_read_mb_per_request": _percentile(read, 50)})
    out["cold_disk_cache_mb"] = table_mb / 4
    shutil.rmtree(art)
    return out


def _spread(xs: list[float]) -> dict:
    return {"median": _percentile(xs, 50), "min": min(xs), "max": max(xs), "n": len(xs)}


def _delta_of_one_percent(model, item_ids, item_features, base: Path, tmp: Path) -> tuple[Path, int]:
    """A live delta against `base` in which 1% of the item rows changed (the model is
    changed in place)."""
    from genrec.models.serving.artifact import export_artifact
    from genrec.models.serving.delta import write_delta

    table = model.embeddings.embeddings["t_item_id"].weight
    rows = torch.randperm(table.shape[0], generator=torch.Generator().manual_seed(1))[: table.shape[0] // 100]
    with torch.no_grad():
        table[rows] += 0.01
    new = export_artifact(model, {}, tmp / "fp32-next", dtype="fp32", item_ids=item_ids,
                          item_features=item_features, version="bench-fp32-next", export_program=False)
    delta = write_delta(new, base, tmp / "delta")
    shutil.rmtree(new)
    return delta, int(rows.numel())


def _timed_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def run(quick: bool) -> dict:
    from genrec.models.serving.artifact import export_artifact
    from genrec.models.serving.ranker import ServingConfig, load_artifact

    num_items = 20_000 if quick else 1_000_000
    history = 128 if quick else 1024
    k, n = (100, 20) if quick else (500, 50)
    max_seq_len = history + k + 16
    dim = 32 if quick else 64
    # One intra-op thread per worker: the box is 2 shared cores and the load generator needs
    # CPU too; with more threads than free cores, OpenMP spin-waits dominate the latency.
    threads = 1
    torch.set_num_threads(threads)
    t_start = time.time()
    _log(f"building a synthetic model: {num_items:,} items, D={dim}, history {history}, K={k}, N={n}")
    model, item_ids, item_features = build_synthetic_model(num_items=num_items, dim=dim, max_seq_len=max_seq_len)
    result: dict = {"num_items": num_items, "history": history, "k": k, "n": n, "dim": dim, "threads": threads,
                    "server_workers": SERVER_WORKERS}
    with tempfile.TemporaryDirectory(prefix="genrec_bench_serve_") as tmp:
        arts = {}
        for dtype in ("fp32", "int8"):
            t0 = time.time()
            arts[dtype] = export_artifact(model, {}, Path(tmp) / dtype, dtype=dtype, item_ids=item_ids,
                                          item_features=item_features, version=f"bench-{dtype}",
                                          export_program=False)
            _log(f"exported {dtype} artifact in {time.time() - t0:.1f}s")
        delta, delta_rows = _delta_of_one_percent(model, item_ids, item_features, arts["fp32"], Path(tmp))
        del model
        scfg = ServingConfig(max_k=k, max_history=history)
        requests = [synthetic_request(num_items, history, k=k, n=n, seed=i, item_features=item_features)
                    for i in range(4 if quick else 20)]

        # ---- over HTTP, server in a second process: the int8 artifact (the one the README
        # exports) gives the headline keys, the fp32 artifact the same keys prefixed "fp32_"
        for d, prefix in (("int8", ""), ("fp32", "fp32_")):
            result.update({prefix + key: v for key, v in _over_http(arts[d], requests, k, history, threads,
                                                                    quick).items()})
            _log(f"{d} artifact over HTTP: p50 {result[prefix + 'p50_ms']:.1f} ms, p99 {result[prefix + 'p99_ms']:.1f} "
                 f"ms single stream, {result[prefix + 'qps']:.1f} QPS with {result['qps_clients']} clients")

        # ---- in process: M-FALCON vs recompute, int8 vs fp32
        rankers = {d: load_artifact(arts[d], scfg) for d in arts}
        r32 = rankers["fp32"]
        hist = r32._history(_as_request(requests[0]))
        user, cache = r32.encode([hist])
        scores, idx = r32.retrieve(user, k, [{}])
        cand = idx[0]
        t_mf = _time_calls(lambda: r32.score_candidates(r32.encode([hist])[1], [cand], [hist["request_time"]]),
                           3 if quick else 5, 20)
        budget_rc = 4 if quick else 120
        t0 = time.perf_counter()
        n_rc = 0
        probs_rc = []
        for c0 in range(0, k, 16):  # a bounded sample of the K candidates, scaled up
            probs_rc.append(r32.score_candidates_recompute(hist, cand[c0 : c0 + 16], hist["request_time"]))
            n_rc += min(16, k - c0)
            if time.perf_counter() - t0 > budget_rc:
                break
        t_rc_ms = (time.perf_counter() - t0) * 1000 * k / n_rc
        probs_mf = r32.score_candidates(cache, [cand], [hist["request_time"]])
        result["mfalcon_ms"] = _percentile(t_mf, 50)
        result["recompute_ms_estimated"] = t_rc_ms
        result["recompute_candidates_timed"] = n_rc
        result["mfalcon_speedup"] = t_rc_ms / result["mfalcon_ms"]
        result["mfalcon_vs_recompute_max_abs_diff"] = float((probs_mf[:n_rc] - torch.cat(probs_rc)).abs().max())
        _log(f"M-FALCON {result['mfalcon_ms']:.1f} ms vs recompute {t_rc_ms:.0f} ms (est. from {n_rc} candidates): "
             f"{result['mfalcon_speedup']:.1f}x")
        lat_d = {}
        for d, rk in rankers.items():
            reqs = [_as_request(r) for r in requests]
            rk.rank(reqs[0])
            j = [0]

            def call(rk=rk, reqs=reqs):
                rk.rank(reqs[j[0] % len(reqs)])
                j[0] += 1
            lat_d[d] = _percentile(_time_calls(call, 10 if quick else 40, 4 if quick else 40), 50)
            result[f"{d}_inprocess_p50_ms"] = lat_d[d]
            result[f"{d}_memory_bytes"] = rk.memory_bytes()
        # Tables larger than memory are read from the mapped files.
        result.update(_cold_tables(arts["fp32"], scfg, num_items, history, k, n, item_features, quick))
        from genrec.models.serving.delta import apply_delta
        from genrec.models.serving.ranker import Ranker

        applied = [_timed_ms(lambda: Ranker(apply_delta(r32.contents, delta), scfg)) / 1000 for _ in range(3)]
        result.update(delta_apply_s=_percentile(applied, 50), delta_apply_s_spread=_spread(applied),
                      delta_rows=delta_rows)
        _log(f"applying a delta of {delta_rows} item rows: {result['delta_apply_s']:.2f} s")
        result["int8_vs_fp32_latency_ratio"] = lat_d["int8"] / lat_d["fp32"]
        result["int8_vs_fp32_memory_ratio"] = result["int8_memory_bytes"] / result["fp32_memory_bytes"]
        quality = quantization_quality(rankers["fp32"], rankers["int8"], requests)
        result["fp32_stage_ms"] = _stage_times(r32, requests[0], k)
        result["int8_stage_ms"] = _stage_times(rankers["int8"], requests[0], k)
        result.update({f"int8_{key}": v for key, v in quality.items()})
        result.update(_history_dtypes(rankers["int8"], scfg, requests, k))
        _log(f"int8/fp32 latency {result['int8_vs_fp32_latency_ratio']:.2f}, memory "
             f"{result['int8_vs_fp32_memory_ratio']:.2f}, AUC change {quality['auc_change']:+.4f}")
    result["targets_met"] = {
        "p99_under_25ms": result["p99_ms"] < 25,
        "qps_100_p99_under_load_100ms": result["qps"] >= 100 and result["p99_ms_under_load"] < 100,
        "mfalcon_10x": result["mfalcon_speedup"] >= 10, "delta_apply_under_1s": result["delta_apply_s"] < 1}
    if os.environ.get("GENREC_BENCH_SERVE_ANN", "1") == "0":
        _log("approximate retrieval index: left out (GENREC_BENCH_SERVE_ANN=0)")
        result["ann_skipped"] = True
    else:
        ann_items = 200_000 if quick else 10_000_000
        _log(f"approximate retrieval index over {ann_items} clustered vectors (dim {dim}, K={ANN_K})")
        result.update(bench_ann(ann_items, dim, ANN_K, num_queries=30 if quick else 100))
        _log(f"ANN: recall@{ANN_K} {result[f'recall_at_{ANN_K}_vs_exact']:.3f} at nprobe "
             f"{result['ann_nprobe']}/{result['ann_nlist']}, p99 {result['ann_retrieve_p99_ms']:.1f} ms, "
             f"built in {result['ann_build_s']:.0f} s")
        result["targets_met"]["ann_recall_0p95_p99_under_30ms"] = (
            result[f"recall_at_{ANN_K}_vs_exact"] >= 0.95 and result["ann_retrieve_p99_ms"] < 30)
    result["wall_s"] = time.time() - t_start
    return result


SERVER_WORKERS = 2
"""The HTTP server's batch workers (`genrec serve --workers`), one intra-op thread each: two
batches rank at once on the 2 cores."""


def _over_http(artifact: Path, requests: list[dict], k: int, history: int, threads: int, quick: bool) -> dict:
    """Single-stream p50 / p99, then QPS and p99 under load of 4 and of 16 concurrent
    clients, against a server process of this artifact on loopback, and the server's mean
    batch (its /metrics)."""
    import httpx

    port = _free_port()
    proc = start_server_process(artifact, port, threads=threads,
                                extra=["--max-k", str(k), "--max-history", str(history),
                                       "--workers", str(SERVER_WORKERS)])
    out: dict = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0) as client:
            for r in requests[:3]:  # warm-up
                client.post("/v1/rank", json=r).raise_for_status()
            i = [0]

            def one():
                client.post("/v1/rank", json=requests[i[0] % len(requests)]).raise_for_status()
                i[0] += 1
            lats = [_time_calls(one, 30 if quick else 200, 6 if quick else 90) for _ in range(HTTP_ROUNDS)]
        p50s, p99s = [_percentile(lat, 50) for lat in lats], [_percentile(lat, 99) for lat in lats]
        out.update(p50_ms=_percentile(p50s, 50), p50_ms_spread=_spread(p50s), p99_ms=_percentile(p99s, 50),
                   p99_ms_spread=_spread(p99s), num_latency_requests=sum(len(lat) for lat in lats))
        out["server_batch_size_mean_single_stream"] = _mean_batch(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
        # Under load: 4 clients (the headline `qps`, `p99_ms_under_load`), then 16; each
        # client sends its next request when the last is answered.
        for num_clients, suffix in ((4, ""), (16, "_16_clients")):
            out.update(_under_load(port, requests, num_clients, quick, suffix))
        out["qps_clients"] = 4
        out["server_batch_size_mean"] = _mean_batch(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


def _under_load(port: int, requests: list[dict], num_clients: int, quick: bool, suffix: str = "") -> dict:
    """QPS and per-request p99 of `num_clients` closed-loop clients (HTTP_ROUNDS rounds of
    3 / 30 requests per client), errors, and the server's mean batch over these requests;
    each key ends in `suffix` (before "_spread")."""
    import httpx

    per_client = 3 if quick else 30
    errors: list[int] = []
    qps, p99s = [], []
    url = f"http://127.0.0.1:{port}"

    def batches() -> tuple[float, float]:
        return _batch_totals(httpx.get(url + "/metrics").text)

    before = batches()
    for _ in range(HTTP_ROUNDS):
        lat: list[float] = []

        def client_loop(c):
            with httpx.Client(base_url=url, timeout=60.0) as cl:
                for j in range(per_client):
                    t0 = time.perf_counter()
                    r = cl.post("/v1/rank", json=requests[(c + j) % len(requests)])
                    lat.append((time.perf_counter() - t0) * 1000)
                    if r.status_code != 200:
                        errors.append(r.status_code)
        t0 = time.perf_counter()
        ts = [threading.Thread(target=client_loop, args=(c,)) for c in range(num_clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        qps.append(num_clients * per_client / (time.perf_counter() - t0))
        p99s.append(_percentile(lat, 99))
    after = batches()
    x = suffix
    return {f"qps{x}": _percentile(qps, 50), f"qps{x}_spread": _spread(qps),
            f"p99_ms_under_load{x}": _percentile(p99s, 50), f"p99_ms_under_load{x}_spread": _spread(p99s),
            f"qps_errors{x}": len(errors),
            f"server_batch_size_mean_under_load{x}": (after[0] - before[0]) / max(1.0, after[1] - before[1])}


def _stage_times(ranker, request: dict, k: int, repeats: int = 3) -> dict[str, float]:
    """Median in-process time of each serving step for one request (where latency goes)."""
    req = _as_request(request)
    steps = {}

    def timed(name, fn):
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn()
            ts.append((time.perf_counter() - t0) * 1000)
        steps[name] = _percentile(ts, 50)
        return out

    hist = timed("parse_history", lambda: ranker._history(req))
    timed("history_tokens", lambda: ranker.history_tokens([hist]))
    user, cache = timed("encode_history", lambda: ranker.encode([hist]))
    _, idx = timed("retrieve", lambda: ranker.retrieve(user, k, [{}]))
    timed("rank_candidates", lambda: ranker.score_candidates(cache, [idx[0]], [hist["request_time"]]))
    return steps


def _history_dtypes(served, scfg, requests: list[dict], k: int) -> dict:
    """The dtype the `served` ranker's rank step scores in (ServingConfig.history_dtype, "auto"
    unless set) and what bf16 scores give against fp32 on its artifact: ranking AUC change and largest probability
    difference (quantization_quality's measures) and the rank step's time, side by side."""
    import dataclasses

    from genrec.models.serving.ranker import load_artifact

    by = {d: load_artifact(served.path, dataclasses.replace(scfg, history_dtype=d)) for d in ("fp32", "bf16")}
    q = quantization_quality(by["fp32"], by["bf16"], requests)
    rank_ms = {d: [] for d in by}
    for _ in range(3):  # alternating, so drift of the machine falls on both
        for d, r in by.items():
            rank_ms[d].append(_stage_times(r, requests[0], k, repeats=5)["rank_candidates"])
    ratios = [b / f for b, f in zip(rank_ms["bf16"], rank_ms["fp32"])]
    history = len(requests[0]["item_ids"])
    return {"score_dtype": str(served.score_dtype(k, history)).removeprefix("torch."),
            "bf16_history_auc_change": q["auc_change"], "bf16_history_max_abs_prob_diff": q["max_abs_prob_diff"],
            "bf16_history_num_scored": q["num_scored"],
            "bf16_history_rank_ms": _percentile(rank_ms["bf16"], 50), "fp32_history_rank_ms": _percentile(rank_ms["fp32"], 50),
            "bf16_vs_fp32_history_rank_time_ratio": _percentile(ratios, 50),
            "bf16_vs_fp32_history_rank_time_ratio_spread": _spread(ratios)}


def _as_request(d: dict):
    from genrec.models.serving.ranker import RankRequest

    return RankRequest(**d)


def _batch_totals(metrics_text: str) -> tuple[float, float]:
    """(requests, batches) the server has ranked: its batch-size histogram's sum and count."""
    total = count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("genrec_batch_size_sum"):
            total = float(line.split()[-1])
        elif line.startswith("genrec_batch_size_count"):
            count = float(line.split()[-1])
    return total, count


def _mean_batch(metrics_text: str) -> float | None:
    total, count = _batch_totals(metrics_text)
    return total / count if count else None


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
