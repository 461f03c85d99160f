"""The serving path: one request -> retrieved, ranked ads, from an exported artifact.

    ranker = load_artifact("artifacts/v1")
    ranker.rank({"item_ids": [11, 12, 13], "actions": [1, 0, 1], "timestamps": [100, 160, 200],
                 "k": 500, "n": 50})
    -> {"model_version": "v1", "history_used": 3, "history_truncated": False,
        "items": [{"item_id": 31, "score": 0.41, "retrieval_score": 0.83,
                   "probabilities": {"click": 0.41, "conversion": 0.05}}, ...]}

One call, four steps (`rank_batch` does them for several requests at once):

1. Encode each history once with the dense tower, keeping each layer's keys / values.
2. Retrieve the top K items by inner product of the last history state with the item index
   (both L2-normalized under `model.similarity = "cosine"`, raw under "dot"): exact, one native
   scan of the index (dense/csrc/topk_scan.c; a matmul + top-k per block of rows without it);
   or, for an artifact exported with an approximate index, an IVF search (models/serving/ann.py).
3. Rank those K as candidates appended after the history under the target-aware mask, in
   micro-batches of `micro_batch` candidates that reuse the cached history (M-FALCON):
   each micro-batch costs O(history) per layer instead of a full re-encode. Per-task
   probabilities (e.g. pCTR, pCVR) come from the model's task heads.
4. Return the top N by the requested task's probability (or the retrieval score).

Parity with the training model (tests/models/serving/test_serving.py): an fp32 artifact
scored in fp32 (`history_dtype = "fp32"`) reproduces `GenerativeRecommender`'s retrieval top K
and ranking probabilities within 1e-4; int8 stays within 0.01 absolute per probability
(measured <= 3e-3; ranking AUC change ~2e-4 and retrieval NDCG@N vs fp32 ~0.99 in `genrec
bench serve`); fp16 within 1e-3; bf16 scores against the history (the "auto" choice for long
histories and many candidates on CPUs with native bf16) within 2e-3 (measured ~2e-4).

History rules (documented to clients): events may arrive in any order; they are sorted by
timestamp (stable), and a history longer than `max_history` keeps its most recent events
(`exclude_seen` filters the items of all of it, as `genrec eval` filters every seen item).
Candidate features other than the item id (advertiser, campaign, category, ...) come from
the artifact's item index, unless the request's `context` gives a value for all candidates
(slot, device: features of the ad request rather than of the ad); history events take them from `features` when given, else from
the item index too (unknown items read the default row).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.profiler import record_function

from genrec.data.config import FeatureSpec
from genrec.data.files import unreplaced
from genrec.dense import fused
from genrec.models.ids import sorted_positions
from genrec.models.config_loader import from_dict
from genrec.models.serving.ann import ANN_FILE, IVFRetriever, merge_top_k
from genrec.models.serving.ann import manifest_entry as ann_manifest_entry
from genrec.models.serving.artifact import (
    DENSE_FILE, MANIFEST, ArtifactContents, ServingTable, load_artifact_contents,
)
from genrec.models.serving.config import ServingConfig
from genrec.models.serving.mapped import RowCache
from genrec.models.model import GenerativeRecommender, ModelConfig, retrieval_vectors

RETRIEVAL = "retrieval"
AUTO_BF16_MIN_SCORES = 1 << 17
"""history_dtype = "auto" scores in bf16 from this many scores per user and head (candidates
per micro-batch x history length). Rank step, bf16 / fp32 time on one AVX-512 BF16 thread, 2
layers: 500 candidates against 1,024 events 0.70 (d_qk 32) / 0.84 (d_qk 16), against 512
0.77 / 0.90, against 256 0.97; 100 candidates against 1,024 0.97 / 1.10, against 128 1.20
(converting costs more than small products gain)."""


@dataclass(kw_only=True)
class RankRequest:
    item_ids: list[int]
    """Item id of each recent event of the user."""
    actions: list[int]
    """Action code of each event (aligned with item_ids)."""
    timestamps: list[int]
    """Event time of each event, unix seconds (aligned with item_ids)."""
    features: dict[str, list[int]] = field(default_factory=dict)
    """Optional per-event values of other sparse features (aligned with item_ids)."""
    context: dict[str, int] = field(default_factory=dict)
    """Optional request context for the candidates (e.g. {"slot": 3, "device": 1}): one value
    per feature, given to every candidate instead of the item index's value."""
    k: int = 500
    """Items retrieved and ranked."""
    n: int = 50
    """Items returned."""
    exclude_seen: bool = False
    """Never return an item of the request's history: all of it, also the events beyond
    `max_history` that the model does not read."""
    allowed_advertisers: list[int] | None = None
    """Only items of these advertisers (None: all)."""
    request_time: int | None = None
    """Time the candidates are scored at; None: the latest history timestamp."""
    sort_by: str | None = None
    """A ranking task name or "retrieval"; None: the first ranking task (retrieval when the
    model has no ranking head)."""


class RequestError(ValueError):
    """A request this model cannot answer; `field` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class _NoEmbeddings(nn.Module):
    """Placeholder: serving looks rows up in the artifact's tables directly."""


class Ranker:
    """A loaded artifact answering rank requests. Not thread-safe: one caller at a time."""

    def __init__(self, contents: ArtifactContents, cfg: ServingConfig | None = None,
                 tower_builder: Callable[[dict], nn.Module] | None = None) -> None:
        self.cfg = cfg or ServingConfig()
        self.manifest = m = contents.manifest
        self.version: str = m["version"]
        self.dtype: str = m["dtype"]
        self.path = contents.path
        self.contents = contents  # the base of a live delta (models/serving/delta.py)
        where = contents.path / MANIFEST
        features = _manifest_section(FeatureSpec, m, "features", where)
        model_cfg = _manifest_section(ModelConfig, m, "model", where)
        _check_feature_tables(m, features, contents, where)
        try:
            tower = (tower_builder or _build_tower)(m["tower"])
            self.model = GenerativeRecommender(features=features, cfg=model_cfg, embeddings=_NoEmbeddings(),
                                               feature_dims=m["feature_dims"], tower=tower, dim=m["dim"])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        try:
            result = self.model.load_state_dict(contents.dense_state, strict=False)
        except RuntimeError as e:  # a tensor of another shape: the manifest's tower / model do not fit it
            raise ValueError(f"{where}: 'tower' / 'model' do not fit {DENSE_FILE} ({e})") from None
        missing = [k for k in result.missing_keys if not k.startswith("embeddings.")]
        if missing or result.unexpected_keys:
            raise ValueError(f"{where}: 'tower' / 'model' do not fit {DENSE_FILE}: missing {missing}, "
                             f"unexpected {result.unexpected_keys}")
        self.model.eval()
        self.model.requires_grad_(False)  # inference only: no autograd graph on any path
        self.features = features
        self.tasks: list[str] = list(model_cfg.ranking_tasks) if model_cfg.ranking else []
        self.table_of: dict[str, ServingTable] = {}
        for name, meta in m["tables"].items():
            for f in meta["features"]:
                self.table_of[f] = contents.tables[name]
        cache_bytes = int(self.cfg.table_cache_mb * 2**20)
        for table in contents.tables.values():
            # A live delta's model keeps its base's caches (its tables share the base's rows).
            if table.cache is None and 0 < cache_bytes < table.ids_N.numel() * table.dim * 4:
                table.cache = RowCache(table.ids_N.numel(), table.dim, cache_bytes)
        self.item_ids_N = contents.item_ids_N
        self.item_side = contents.item_side_features
        adv = self.cfg.advertiser_feature
        if adv != ServingConfig.advertiser_feature and adv not in self.item_side:  # asked for, not there
            raise ValueError(f"ServingConfig.advertiser_feature (--advertiser-feature) {adv!r} is not an item "
                             f"feature of this artifact; it has {sorted(self.item_side)}")
        self.item_scale_N = contents.item_scale_N
        # Where each retrieval-index item sits in the item table, found once: candidates (index
        # positions) and history items found in the index then read their rows without a
        # search of the table per request (about 0.3-0.6 ms each at 1M items, the table's ids
        # being cold after the retrieval scan).
        item_table = self.table_of.get(features.item)
        self._item_table_at = None if item_table is None else item_table.positions(self.item_ids_N)
        ann = ann_manifest_entry(m)
        self.ann = None
        if ann is not None and not self.cfg.exact_retrieval:
            if ann.get("file") != ANN_FILE or ANN_FILE not in m["files"] or "nprobe" not in ann:
                raise ValueError(f"{where}: 'item_index.ann' must name the listed file {ANN_FILE} and its nprobe")
            self.ann = IVFRetriever(contents.path / ANN_FILE, ann, int(self.item_ids_N.numel()),
                                    int(contents.item_rows_ND.shape[1]), self.cfg.ann_nprobe)
        # Tables and the item index stay memory-mapped (safetensors maps the files; a lookup
        # pages in the rows it reads). The exact index is scanned whole by every request, so
        # it is prepared in memory, unless the approximate index answers instead: fp16 rows
        # widened once (CPU matmuls are no faster in fp16, and a per-request conversion
        # would cost more than the matmul). The native scan (dense/csrc/topk_scan.c) reads
        # int8 and fp32 rows as they are; without it (GENREC_DENSE_FUSED=0) int8 rows are
        # packed for FBGEMM's GEMM, a second copy.
        self.item_rows_ND = contents.item_rows_ND
        self._int8_blocks = None
        self._native_scan = False
        if self.ann is None:
            if self.item_rows_ND.dtype == torch.float16:
                self.item_rows_ND = self.item_rows_ND.float()
            self._native_scan = fused.library() is not None and self.item_rows_ND.is_contiguous()
            if self.item_scale_N is not None and not self._native_scan:
                self._int8_blocks = self._pack_int8_index()
        self._native_bf16 = fused.has_native_bf16()
        self.side_features = [f for f in self.model.candidate_features if f != features.item]
        max_seq_len = int(m["tower"]["max_seq_len"])
        self.max_k = self.cfg.max_k
        self.max_history = self.cfg.max_history or (max_seq_len - 1)
        if not 1 <= self.max_history < max_seq_len:
            raise ValueError(f"ServingConfig.max_history must be in [1, {max_seq_len - 1}] (the tower's "
                             f"max_seq_len - 1), got {self.max_history}")

    # ---- request handling -----------------------------------------------------------------

    def check(self, req: RankRequest) -> None:
        """RequestError (a ValueError) naming the field of a request this model cannot answer."""
        n_events = len(req.item_ids)
        if n_events == 0:
            raise RequestError("item_ids", "the history needs at least one event")
        if n_events > self.cfg.max_request_events:
            raise RequestError("item_ids", f"{n_events} events, more than the limit {self.cfg.max_request_events}")
        for name in ("actions", "timestamps"):
            if len(getattr(req, name)) != n_events:
                raise RequestError(name, f"{len(getattr(req, name))} values, item_ids has {n_events}")
        for f, vals in req.features.items():
            if f not in self.side_features:
                raise RequestError(f"features.{f}", f"not a context feature of this model ({self.side_features})")
            if len(vals) != n_events:
                raise RequestError(f"features.{f}", f"{len(vals)} values, item_ids has {n_events}")
        for f in req.context:
            if f not in self.side_features:
                raise RequestError(f"context.{f}", f"not a candidate feature of this model ({self.side_features})")
        if not 1 <= req.k <= self.max_k:
            raise RequestError("k", f"too many candidates: must be in [1, {self.max_k}], got {req.k}")
        if not 1 <= req.n <= min(req.k, self.cfg.max_n):
            raise RequestError("n", f"must be in [1, min(k, {self.cfg.max_n})], got {req.n}")
        if req.sort_by is not None and req.sort_by not in self.tasks + [RETRIEVAL]:
            raise RequestError("sort_by", f"{req.sort_by!r} is not one of {self.tasks + [RETRIEVAL]}")
        if req.allowed_advertisers is not None and self.cfg.advertiser_feature not in self.item_side:
            raise RequestError("allowed_advertisers", f"this artifact's items carry no {self.cfg.advertiser_feature!r}")

    def rank(self, request: RankRequest | dict) -> dict[str, Any]:
        return self.rank_batch([request])[0]

    @torch.no_grad()
    def rank_batch(self, requests: list[RankRequest | dict]) -> list[dict[str, Any]]:
        # The record_function ranges are `genrec profile serve`'s stages (about a
        # microsecond each when no profiler runs).
        with record_function("genrec.serve.history"):
            reqs = [r if isinstance(r, RankRequest) else RankRequest(**r) for r in requests]
            for r in reqs:
                self.check(r)
            hist = [self._history(r) for r in reqs]
        with record_function("genrec.serve.encode"):
            user_BD, cache = self.encode(hist)
        ks = [r.k for r in reqs]
        with record_function("genrec.serve.retrieve"):
            masks = [self._filters(r, h) for r, h in zip(reqs, hist)]
            ret_scores, ret_idx = self.retrieve(user_BD, ks, masks)
        cand_idx = []
        for b, k in enumerate(ks):
            keep = torch.isfinite(ret_scores[b, :k])
            cand_idx.append(ret_idx[b, :k][keep])
        probs_CT = None
        if self.tasks:
            times = [h["request_time"] for h in hist]
            with record_function("genrec.serve.rank"):
                probs_CT = self.score_candidates(cache, cand_idx, times, [r.context for r in reqs])
        with record_function("genrec.serve.respond"):
            return self._answers(reqs, hist, cand_idx, ret_scores, probs_CT)

    def _answers(self, reqs, hist, cand_idx, ret_scores, probs_CT) -> list[dict[str, Any]]:
        out, c0 = [], 0
        for b, r in enumerate(reqs):
            idx = cand_idx[b]
            c = idx.numel()
            retrieval = ret_scores[b, :c]
            probs = probs_CT[c0 : c0 + c] if probs_CT is not None else None
            c0 += c
            sort_by = r.sort_by or (self.tasks[0] if self.tasks else RETRIEVAL)
            key = retrieval if sort_by == RETRIEVAL else probs[:, self.tasks.index(sort_by)]
            order = torch.argsort(key, descending=True, stable=True)[: r.n]
            ids = self.item_ids_N[idx[order]].tolist()
            items = []
            for j, pos in enumerate(order.tolist()):
                item = {"item_id": ids[j], "score": float(key[pos]), "retrieval_score": float(retrieval[pos])}
                if probs is not None:
                    item["probabilities"] = {t: float(probs[pos, i]) for i, t in enumerate(self.tasks)}
                items.append(item)
            out.append({"model_version": self.version, "items": items, "history_used": hist[b]["length"],
                        "history_truncated": hist[b]["truncated"]})
        return out

    # ---- the four steps -------------------------------------------------------------------

    def _history(self, req: RankRequest) -> dict[str, Any]:
        """Sorted, truncated history of one request: feature ids and timestamps."""
        ts = torch.tensor(req.timestamps, dtype=torch.int64)
        order = torch.argsort(ts, stable=True)
        truncated = order.numel() > self.max_history
        order = order[-self.max_history :]
        spec = self.features
        items = torch.tensor(req.item_ids, dtype=torch.int64)[order]
        feats = {spec.item: (items, None), spec.action: (torch.tensor(req.actions, dtype=torch.int64)[order], None)}
        pos, known = sorted_positions(self.item_ids_N, items)
        for f in self.side_features:
            if f in req.features:
                feats[f] = (torch.tensor(req.features[f], dtype=torch.int64)[order], None)
            else:
                feats[f] = (self.item_side[f][pos], known)
        ts = ts[order]
        request_time = int(ts[-1]) if req.request_time is None else req.request_time
        return {"features": feats, "timestamps": ts, "length": int(items.numel()), "truncated": truncated,
                "request_time": request_time, "item_at": self._history_item_at(items, pos, known),
                # exclude_seen filters every item of the request, not only the events kept.
                "seen_items": torch.tensor(req.item_ids, dtype=torch.int64)}

    def _history_item_at(self, items: torch.Tensor, pos: torch.Tensor, known: torch.Tensor):
        """(row, found) in the item table of each history item: through the index's map where
        the item is in the index (`pos`, `known`: its index positions), by a search for the rest."""
        if self._item_table_at is None:
            return None
        row, found = (t[pos] for t in self._item_table_at)
        found &= known
        rest = (~known).nonzero().squeeze(1)
        if rest.numel():
            row[rest], found[rest] = self.table_of[self.features.item].positions(items[rest])
        return row, found

    def _rows(self, feature: str, ids: torch.Tensor, known: torch.Tensor | None, at=None) -> torch.Tensor:
        rows = self.table_of[feature].lookup(ids, at)
        return rows if known is None else rows * known.unsqueeze(1)

    def _tokens(self, feats: dict[str, tuple[torch.Tensor, torch.Tensor | None]], keys: list[str],
                which: str, item_at: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`item_at`: the item feature's rows in its table, where the caller has them."""
        # Same combination as GenerativeRecommender._tokens, so fp32 artifacts match bit for bit.
        item = self.features.item
        parts = [self._rows(k, *feats[k], at=item_at if k == item else None) for k in keys]
        if self.model.project is None:
            return torch.stack(parts).sum(0)
        return self.model.project[which](torch.cat(parts, dim=-1))

    def history_tokens(self, hist: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [T, D], offsets [B + 1], timestamps [T]) of a batch of histories."""
        keys = self.features.sparse
        merged = {k: (torch.cat([h["features"][k][0] for h in hist]),
                      None if hist[0]["features"][k][1] is None and all(h["features"][k][1] is None for h in hist)
                      else torch.cat([h["features"][k][1] if h["features"][k][1] is not None
                                      else torch.ones(h["length"], dtype=torch.bool) for h in hist]))
                  for k in keys}
        at = [h.get("item_at") for h in hist]
        item_at = None if any(a is None for a in at) else tuple(torch.cat(parts) for parts in zip(*at))
        tokens_TD = self._tokens(merged, keys, "history", item_at)
        offsets_B1 = torch.tensor([0] + [h["length"] for h in hist]).cumsum(0)
        return tokens_TD, offsets_B1, torch.cat([h["timestamps"] for h in hist])

    def encode(self, hist: list[dict]):
        """Step 1: the histories once through the tower -> (user vectors [B, D] as retrieval
        scores them, `model.similarity`; cache)."""
        tokens_TD, offsets_B1, ts_T = self.history_tokens(hist)
        request_time_B = torch.tensor([h["request_time"] for h in hist], dtype=torch.int64)
        last_BD, cache = self.model.tower.encode_history(tokens_TD, offsets_B1, ts_T, query_time_B=request_time_B,
                                                         last_only=True)
        return retrieval_vectors(last_BD, self.model.cfg.similarity), cache

    def _filters(self, req: RankRequest, hist: dict) -> dict[str, torch.Tensor]:
        masks = {}
        if req.exclude_seen:
            pos, known = sorted_positions(self.item_ids_N, hist["seen_items"])
            masks["exclude"] = pos[known]
        if req.allowed_advertisers is not None:
            adv = self.item_side[self.cfg.advertiser_feature]
            masks["allowed_N"] = torch.isin(adv, torch.tensor(req.allowed_advertisers, dtype=torch.int64))
        return masks

    def retrieve(self, user_BD: torch.Tensor, k: int | list[int], masks: list[dict[str, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2: exact top-k inner products over the item index (the native scan, or block
        by block). `k`: one for all users, or each user's own. Returns (scores [B, k'],
        item-index positions [B, k']), k' = min(max k, items), best first; where filters
        leave fewer than k' items the rest score -inf. An artifact with an approximate index
        searches that instead (models/serving/ann.py), each user at its own k."""
        if self.ann is not None:
            return self.ann.search(user_BD, k, masks)
        k = k if isinstance(k, int) else max(k)
        n = self.item_ids_N.numel()
        B = user_BD.shape[0]
        if self._native_scan:
            # One pass over the index per user that keeps only rows above the running k-th
            # best: no [B, N] score matrix, no top-k over it. Filtered rows never enter.
            mask = None
            if any(masks):
                mask = torch.ones(B, n, dtype=torch.uint8)
                for b, m in enumerate(masks):
                    if "allowed_N" in m:
                        mask[b] = m["allowed_N"]
                    if "exclude" in m:
                        mask[b, m["exclude"]] = 0
            return fused.scan_top_k(user_BD, self.item_rows_ND, self.item_scale_N, min(k, n), mask)
        best_s = user_BD.new_empty((B, 0))
        best_i = torch.empty((B, 0), dtype=torch.int64)
        step = self.cfg.retrieval_block_rows
        for block, s in enumerate(range(0, n, step)):
            e = min(n, s + step)
            if self.item_scale_N is not None:
                scores = self._int8_scores(user_BD, block, s, e)
            else:
                scores = user_BD @ self.item_rows_ND[s:e].T
            for b, mask in enumerate(masks):
                if "allowed_N" in mask:
                    scores[b].masked_fill_(~mask["allowed_N"][s:e], float("-inf"))
                if "exclude" in mask:
                    ex = mask["exclude"]
                    ex = ex[(ex >= s) & (ex < e)] - s
                    scores[b, ex] = float("-inf")
            best_s, best_i = merge_top_k(best_s, best_i, scores, s, k)
        order = best_s.argsort(dim=1, descending=True, stable=True)
        return best_s.gather(1, order), best_i.gather(1, order)

    def _pack_int8_index(self) -> list | None:
        """FBGEMM int8 GEMM weights, one per retrieval block; None where the quantized engine
        is missing (then blocks are dequantized per request: slower, same math)."""
        engines = torch.backends.quantized.supported_engines
        if "fbgemm" not in engines and "x86" not in engines:
            return None
        torch.backends.quantized.engine = "fbgemm" if "fbgemm" in engines else "x86"
        blocks, step, n = [], self.cfg.retrieval_block_rows, self.item_ids_N.numel()
        # torch marks its quantized tensors deprecated (torchao replaces them); until they go,
        # they give FBGEMM's int8 GEMM, about 2x the fp32 matmul here. Gone -> fallback.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                for s in range(0, n, step):
                    e = min(n, s + step)
                    q = torch._make_per_channel_quantized_tensor(
                        self.item_rows_ND[s:e], self.item_scale_N[s:e].double(),
                        torch.zeros(e - s, dtype=torch.int64), 0)
                    blocks.append(torch.ops.quantized.linear_prepack(q, None))
            except (AttributeError, RuntimeError):
                return None
        return blocks

    def _int8_scores(self, user_BD: torch.Tensor, block: int, s: int, e: int) -> torch.Tensor:
        if self._int8_blocks is not None:
            # Dynamic int8 GEMM: the user vectors are quantized per call (uint8, per tensor),
            # so each user goes alone: on the batch's range, a request's scores would depend
            # on the others in its server batch.
            # reduce_range (7-bit activations) is needed on CPUs without VNNI: FBGEMM's AVX2
            # path sums u8*s8 pairs in saturating int16, which clips full-range products.
            w = self._int8_blocks[block]
            return torch.cat([torch.ops.quantized.linear_dynamic(u, w, True) for u in user_BD.split(1)])
        return (user_BD @ self.item_rows_ND[s:e].float().T) * self.item_scale_N[s:e]

    def candidate_tokens(self, cand_idx: list[torch.Tensor], contexts: list[dict[str, int]] | None = None) -> torch.Tensor:
        idx = torch.cat(cand_idx)
        spec = self.features
        feats = {spec.item: (self.item_ids_N[idx], None)}
        counts = torch.tensor([c.numel() for c in cand_idx])
        for f in self.side_features:
            values = self.item_side[f][idx]
            if contexts and any(f in c for c in contexts):
                override = torch.tensor([c.get(f, 0) for c in contexts], dtype=torch.int64)
                has = torch.tensor([f in c for c in contexts])
                values = torch.where(has.repeat_interleave(counts), override.repeat_interleave(counts), values)
            feats[f] = (values, None)
        item_at = None if self._item_table_at is None else tuple(t[idx] for t in self._item_table_at)
        return self._tokens(feats, self.model.candidate_features, "candidates", item_at)

    def score_candidates(self, cache, cand_idx: list[torch.Tensor], times: list[int],
                         contexts: list[dict[str, int]] | None = None) -> torch.Tensor:
        """Step 3 (M-FALCON): candidate probabilities [C, tasks] against the cached histories,
        `micro_batch` candidates per user per tower call."""
        tokens_CD = self.candidate_tokens(cand_idx, contexts)
        counts_B = torch.tensor([c.numel() for c in cand_idx])
        offsets_B1 = torch.cat([torch.zeros(1, dtype=torch.int64), counts_B.cumsum(0)])
        ts_C = torch.repeat_interleave(torch.tensor(times, dtype=torch.int64), counts_B)
        states_CD = tokens_CD.new_empty(tokens_CD.shape)
        # Each user's dtype from its own candidates and history, never from its batch's
        # largest: a request's answer must not depend on the others batched with it.
        dtypes_B = [self.score_dtype(c, h) for c, h in zip(counts_B.tolist(), cache.history_lengths_B.tolist())]
        m = self.cfg.micro_batch
        for dtype in dict.fromkeys(dtypes_B):
            mine_B = torch.tensor([d == dtype for d in dtypes_B])
            part = cache
            if cache.keys and cache.keys[0].dtype != dtype:  # once per call, not per micro-batch
                part = dataclasses.replace(cache, keys=[k.to(dtype) for k in cache.keys],
                                           values=[v.to(dtype) for v in cache.values])
            # A candidate's state depends on the history and itself only (the target-aware
            # mask), so neither the chunk size nor the candidate count is bounded by max_seq_len.
            for c0 in range(0, max([0] + counts_B[mine_B].tolist()), m):
                lo_B = (offsets_B1[:-1] + c0).minimum(offsets_B1[1:])
                hi_B = torch.where(mine_B, (lo_B + m).minimum(offsets_B1[1:]), lo_B)  # others: none this call
                sel = torch.cat([torch.arange(int(a), int(z)) for a, z in zip(lo_B, hi_B)])
                chunk_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), (hi_B - lo_B).cumsum(0)])
                states_CD[sel] = self.model.tower.score_targets(part, tokens_CD[sel], chunk_offsets, ts_C[sel], m)
        return torch.sigmoid(self.model.ranking_logits(self.model.head_input(states_CD, tokens_CD)))

    def score_dtype(self, candidates: int, history: int) -> torch.dtype:
        """Dtype of the scores of `candidates` per user against a history `history` long
        (ServingConfig.history_dtype)."""
        if self.cfg.history_dtype == "auto":
            big = min(candidates, self.cfg.micro_batch) * history >= AUTO_BF16_MIN_SCORES
            return torch.bfloat16 if self._native_bf16 and big else torch.float32
        return torch.bfloat16 if self.cfg.history_dtype == "bf16" else torch.float32

    def score_candidates_recompute(self, hist: dict, cand_idx: torch.Tensor, time: int,
                                   rows_per_call: int = 16) -> torch.Tensor:
        """Baseline for M-FALCON: each candidate scored by a full forward over history +
        that candidate (no cache). Same result, O(history) tower work per candidate."""
        h_TD, _, h_ts = self.history_tokens([hist])
        cand_TD = self.candidate_tokens([cand_idx])
        L = h_TD.shape[0]
        out = []
        for c0 in range(0, cand_TD.shape[0], rows_per_call):
            c = cand_TD[c0 : c0 + rows_per_call]
            r = c.shape[0]
            values = torch.cat([h_TD.unsqueeze(0).expand(r, L, -1), c.unsqueeze(1)], dim=1).reshape(r * (L + 1), -1)
            ts = torch.cat([h_ts.unsqueeze(0).expand(r, L), torch.full((r, 1), time)], dim=1).reshape(-1)
            offsets = torch.arange(r + 1) * (L + 1)
            states = self.model.tower(values, offsets, ts, num_targets_B=torch.ones(r, dtype=torch.int64))
            out.append(states.view(r, L + 1, -1)[:, -1])
        return torch.sigmoid(self.model.ranking_logits(self.model.head_input(torch.cat(out), cand_TD)))

    def table_cache_stats(self) -> dict[str, dict[str, int]]:
        """Per table with a hot-row cache: its capacity, bytes, hits and misses so far."""
        return {name: t.cache.stats() for name, t in self.contents.tables.items() if t.cache is not None}

    def memory_bytes(self) -> int:
        """Bytes held by tables, item index and dense weights."""
        tables = {id(t): t for t in self.table_of.values()}
        total = sum(t.nbytes() for t in tables.values())
        total += self.item_ids_N.nbytes + self.item_rows_ND.nbytes + sum(v.nbytes for v in self.item_side.values())
        if self.item_scale_N is not None:
            total += self.item_scale_N.nbytes
        return total + sum(p.nbytes for p in self.model.parameters())


def _manifest_section(cls: type, manifest: dict, key: str, where: Path):
    """Manifest section `key` as config dataclass `cls`: an unknown key or a value of the
    wrong type is a ValueError naming `key.field`."""
    try:
        return from_dict(cls, manifest[key], prefix=key)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _check_feature_tables(m: dict, features: FeatureSpec, contents: ArtifactContents, where: Path) -> None:
    """Every sparse feature has an integer dimension and a table; every candidate side
    feature has a column in the item index."""
    for f in features.sparse:
        dim = m["feature_dims"].get(f)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"{where}: 'feature_dims.{f}' must be a positive integer (the dimension of "
                             f"sparse feature {f!r}), got {dim!r}")
        if not any(f in meta["features"] for meta in m["tables"].values()):
            raise ValueError(f"{where}: 'features.sparse' names {f!r}, which no entry of 'tables' serves")
        for name, meta in m["tables"].items():
            if f in meta["features"] and contents.tables[name].dim != dim:
                raise ValueError(f"artifact file tables/{name}.safetensors: rows of width {contents.tables[name].dim}, "
                                 f"but {where} gives sparse feature {f!r} dimension {dim} ('feature_dims.{f}')")
        if f not in (features.item, features.action) and f not in contents.item_side_features:
            raise ValueError(f"{where}: candidate side feature {f!r} has no column 'feature.{f}' in the item index")


def _build_tower(tower_cfg: dict) -> nn.Module:
    from genrec.dense.config import TowerConfig
    from genrec.dense.tower import build_tower

    return build_tower(from_dict(TowerConfig, tower_cfg, prefix="tower"))


def load_artifact(artifact_dir: str | os.PathLike, cfg: ServingConfig | None = None,
                  tower_builder: Callable[[dict], nn.Module] | None = None) -> Ranker:
    """Verify and load an exported artifact into a `Ranker` (no pickle: JSON + safetensors).
    Refused if the directory is replaced meanwhile (`genrec export --overwrite` renames the
    new one into place): its files would be read under the manifest verified before."""
    root = Path(artifact_dir)
    with unreplaced(root, "artifact"):
        return Ranker(load_artifact_contents(root), cfg, tower_builder)
