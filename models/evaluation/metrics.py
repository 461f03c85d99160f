"""Offline-evaluation metrics: streaming accumulators fed by batches of scores.

Shape legend: B users in a batch, N items in the full corpus, C ranking candidates in a
batch (all users together), L ranking tasks, U users seen so far, R bootstrap resamples.

Retrieval (full corpus, leave-one-out): each user has one held-out target item. The model
scores all N items; the items the user has already seen are removed from the ranking (the
target itself is never removed), and the 0-based rank of the target decides the metrics.

    scores_BN = [[0.9, 0.1, 0.5, 0.5],      target_idx_B = [2, 0]
                 [0.2, 0.8, 0.3, 0.1]]      exclude = [[0, -1], [1, 2]]  (padded with -1)
    user 0: item 0 is seen and removed; item 3 ties with the target (0.5): pessimistic -> rank 1
    user 1: items 1, 2 removed; nothing left scores >= 0.2 except the target -> rank 0

    rank_B = [1, 0];  HR@1 = 0.5, NDCG@1 = 0.5, MRR = (1/2 + 1) / 2 = 0.75

Tie rule (retrieval): pessimistic. Every other non-excluded item whose score is >= the
target's counts as ranked above it, so a model that outputs a constant gets the worst rank,
not the best, and ranks are integers (HR@K stays a 0/1 per user). NaN scores are rejected;
-inf is allowed (e.g. to mask padding items) and ties with other -inf items the same way.

Per-user formulas, r the 0-based rank: HR@K = [r < K]; NDCG@K = [r < K] / log2(r + 2) (one
relevant item, so the ideal DCG is 1); MRR = 1 / (r + 1), not truncated at any K.

Ranking (per task, e.g. click / conversion), over candidates with 0/1 labels:
- AUC: Mann-Whitney U with average ranks, i.e. a positive tied with a negative gets half
  credit (the same as the trapezoidal ROC area).
- GAUC: per-user AUC weighted by that user's impressions; users whose candidates are all one
  class have no AUC and are skipped and counted (`gauc_skipped_users`).
- log loss with probabilities clipped to [1e-7, 1 - 1e-7]; NE = log loss / entropy of the base
  rate (null when the base rate is 0 or 1); calibration = sum(pred) / sum(label) (null with no
  positives); a reliability curve over `num_bins` equal-width bins [low, high) of [0, 1].

Undefined metrics (no users, one class only) are None, never NaN, so they go to JSON as null.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

LOG_LOSS_EPS = 1e-7
"""Probabilities are clipped to [eps, 1 - eps] before the log so one confident mistake gives a
large finite loss instead of inf."""


# --------------------------------------------------------------------------- retrieval


def _exclude_pairs(exclude: Any, num_users: int, num_items: int, device: torch.device):
    """(rows_E, cols_E) of the excluded (user, item) pairs from padded or jagged indices,
    deduplicated: the same item twice in a history must be removed once, not twice."""
    if isinstance(exclude, tuple):
        values_S, offsets_B1 = (torch.as_tensor(x, device=device) for x in exclude)
        if offsets_B1.numel() != num_users + 1:
            raise ValueError(
                f"exclude: jagged offsets have {offsets_B1.numel()} entries, expected B + 1 = {num_users + 1}"
            )
        rows_S = torch.repeat_interleave(torch.arange(num_users, device=device), offsets_B1.diff())
        cols_S = values_S.long()
    else:
        if exclude.dim() != 2 or exclude.shape[0] != num_users:
            raise ValueError(f"exclude: padded indices have shape {tuple(exclude.shape)}, expected [B={num_users}, S]")
        exclude = exclude.to(device).long()
        rows_S = torch.arange(num_users, device=device)[:, None].expand_as(exclude)[exclude >= 0]
        cols_S = exclude[exclude >= 0]
    if cols_S.numel() and (int(cols_S.min()) < 0 or int(cols_S.max()) >= num_items):
        raise ValueError(f"exclude: item index out of range [0, {num_items})")
    # sort + adjacent compare: several times faster than torch.unique on CPU.
    keys_S = torch.sort(rows_S * num_items + cols_S).values
    first_S = torch.ones_like(keys_S, dtype=torch.bool)
    first_S[1:] = keys_S[1:] != keys_S[:-1]
    pairs_E = keys_S[first_S]
    return pairs_E // num_items, pairs_E % num_items


def _count_true(mask_BN: torch.Tensor) -> torch.Tensor:
    # Summing bytes into int32 is ~1.5x faster on CPU than bool.sum(), which widens to int64.
    return mask_BN.view(torch.uint8).sum(1, dtype=torch.int32).long()


def rank_of_target(
    scores_BN: torch.Tensor,
    target_idx_B: torch.Tensor,
    exclude: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """0-based rank of each user's target among all items, seen items removed.

    `exclude` (the user's already-seen items) is one of: a bool [B, N] mask; int [B, S] item
    indices padded with negative values; or a jagged pair (values_S, offsets_B1). The target
    is never excluded even if listed. Ties are pessimistic (see the module docstring).
    Returns int64 [B] on the scores' device.
    """
    if scores_BN.dim() != 2:
        raise ValueError(f"scores_BN must be 2-D [B, N], got shape {tuple(scores_BN.shape)}")
    num_users, num_items = scores_BN.shape
    target_idx_B = target_idx_B.to(scores_BN.device).long()
    if target_idx_B.shape != (num_users,):
        raise ValueError(f"target_idx_B has shape {tuple(target_idx_B.shape)}, expected ({num_users},)")
    if num_users and (int(target_idx_B.min()) < 0 or int(target_idx_B.max()) >= num_items):
        raise ValueError(f"target_idx_B: item index out of range [0, {num_items})")
    # One float sum is far cheaper than a [B, N] isnan pass; only a non-finite sum (NaN, or
    # +inf and -inf together) needs the exact check.
    if not torch.isfinite(scores_BN.sum()) and torch.isnan(scores_BN).any():
        raise ValueError("scores_BN contains NaN")
    target_B1 = scores_BN.gather(1, target_idx_B[:, None])
    beats_BN = scores_BN >= target_B1
    if isinstance(exclude, torch.Tensor) and exclude.dtype == torch.bool:
        if tuple(exclude.shape) != (num_users, num_items):
            raise ValueError(f"exclude: bool mask has shape {tuple(exclude.shape)}, expected {(num_users, num_items)}")
        mask_BN = exclude.to(scores_BN.device)
        beats_BN &= ~mask_BN
        # Only subtract the target's self-tie when the mask did not already remove it; this
        # keeps "the target is never excluded" without copying the caller's mask.
        target_kept_B = ~mask_BN.gather(1, target_idx_B[:, None]).squeeze(1)
        return _count_true(beats_BN) - target_kept_B.long()
    # The target always ties with itself, hence the -1.
    rank_B = _count_true(beats_BN) - 1
    if exclude is None:
        return rank_B
    # Index forms: subtract the excluded items that were counted, touching only the S seen
    # items per user instead of building a [B, N] mask (4x slower at N = 100k).
    rows_E, cols_E = _exclude_pairs(exclude, num_users, num_items, scores_BN.device)
    counted_E = (scores_BN[rows_E, cols_E] >= target_B1[rows_E, 0]) & (cols_E != target_idx_B[rows_E])
    return rank_B - torch.bincount(rows_E[counted_E], minlength=num_users)


MISSED = 1 << 62
"""The rank of a target the corpus does not hold: a miss at every K, reciprocal rank 0 (a
rank of N would be a hit at K > N)."""


def retrieval_values_from_ranks(ranks_U: np.ndarray | torch.Tensor, ks: Sequence[int]) -> dict[str, np.ndarray]:
    """Per-user metric values (float64 [U]) keyed `hr@K`, `ndcg@K`, `mrr`; a rank of
    `MISSED` scores 0 in all."""
    ranks_U = np.asarray(torch.as_tensor(ranks_U).cpu(), dtype=np.int64)
    found_U = ranks_U < MISSED
    ranks_U = np.where(found_U, ranks_U, 0).astype(np.float64)
    out: dict[str, np.ndarray] = {}
    for k in ks:
        hit_U = found_U & (ranks_U < k)
        out[f"hr@{k}"] = hit_U.astype(np.float64)
        out[f"ndcg@{k}"] = np.where(hit_U, 1.0 / np.log2(ranks_U + 2.0), 0.0)
    out["mrr"] = np.where(found_U, 1.0 / (ranks_U + 1.0), 0.0)
    return out


class RetrievalMetrics:
    """Streaming HR@K / NDCG@K / MRR over users. Memory: one int64 rank per user (kept for the
    bootstrap and slices when `keep_ranks`), never scores.

    >>> m = RetrievalMetrics(ks=(10, 50, 200))
    >>> m.update(scores_BN, target_idx_B, exclude=seen_idx_BS)   # per batch
    >>> m.compute()  # {"count": U, "hr@10": ..., "ndcg@10": ..., ..., "mrr": ...}
    """

    def __init__(self, ks: Sequence[int] = (10, 50, 200), keep_ranks: bool = True):
        if not ks or any(int(k) < 1 for k in ks):
            raise ValueError(f"ks must be positive cutoffs, got {list(ks)}")
        self.ks = tuple(int(k) for k in ks)
        self.keep_ranks = keep_ranks
        self.count = 0
        # Float64 running sums: a float32 sum of ~1e7 per-user values would lose digits.
        self._sums = {name: 0.0 for name in self.metric_names}
        self._rank_chunks: list[np.ndarray] = []

    @property
    def metric_names(self) -> list[str]:
        return [f"{m}@{k}" for k in self.ks for m in ("hr", "ndcg")] + ["mrr"]

    def update(
        self,
        scores_BN: torch.Tensor,
        target_idx_B: torch.Tensor,
        exclude: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Rank the targets (see `rank_of_target`), accumulate, and return the ranks (int64 [B],
        on CPU) so the caller can feed the same ranks to a `SlicedMetrics`."""
        ranks_B = rank_of_target(scores_BN, target_idx_B, exclude).cpu()
        self.update_ranks(ranks_B)
        return ranks_B

    def update_ranks(self, ranks_B: torch.Tensor | np.ndarray) -> None:
        ranks_B = np.asarray(torch.as_tensor(ranks_B).cpu(), dtype=np.int64).reshape(-1)
        if ranks_B.size and ranks_B.min() < 0:
            raise ValueError("update_ranks: ranks must be >= 0 (0-based)")
        for name, values_B in retrieval_values_from_ranks(ranks_B, self.ks).items():
            self._sums[name] += float(values_B.sum())
        self.count += int(ranks_B.size)
        if self.keep_ranks:
            self._rank_chunks.append(ranks_B)

    def merge(self, other: "RetrievalMetrics") -> None:
        """Add another accumulator's users (e.g. gathered from another rank)."""
        if other.ks != self.ks:
            raise ValueError(f"merge: ks differ ({self.ks} vs {other.ks})")
        for name in self._sums:
            self._sums[name] += other._sums[name]
        self.count += other.count
        self._rank_chunks.extend(other._rank_chunks)

    def ranks(self) -> np.ndarray:
        """int64 [U]: every user's rank, in update order."""
        if not self.keep_ranks:
            raise ValueError("RetrievalMetrics(keep_ranks=False) keeps no per-user ranks")
        return np.concatenate(self._rank_chunks) if self._rank_chunks else np.zeros(0, dtype=np.int64)

    def per_user(self) -> dict[str, np.ndarray]:
        """Per-user values [U] per metric, for `bootstrap_ci` / `paired_bootstrap`."""
        return retrieval_values_from_ranks(self.ranks(), self.ks)

    def compute(self) -> dict[str, Any]:
        out: dict[str, Any] = {"count": self.count}
        for name, total in self._sums.items():
            out[name] = total / self.count if self.count else None
        return out


# --------------------------------------------------------------------------- ranking


def _average_ranks_within_groups(group_S: np.ndarray, scores_S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort by (group, score) and give each element its 1-based rank inside its group, tied
    scores sharing the average rank. Returns (order_S, ranks_S) with ranks in sorted order."""
    order_S = np.lexsort((scores_S, group_S))
    g_S, s_S = group_S[order_S], scores_S[order_S]
    n = len(order_S)
    pos_S = np.arange(n, dtype=np.float64)
    group_start_S = np.r_[True, g_S[1:] != g_S[:-1]] if n else np.zeros(0, dtype=bool)
    tie_start_S = group_start_S | np.r_[True, s_S[1:] != s_S[:-1]] if n else group_start_S
    # Position of the first element of each user, broadcast to the user's elements.
    first_of_group_S = pos_S[group_start_S][np.cumsum(group_start_S) - 1]
    tie_id_S = np.cumsum(tie_start_S) - 1
    tie_first = pos_S[tie_start_S]
    tie_last = np.r_[tie_first[1:] - 1, n - 1] if n else tie_first
    avg_pos_S = ((tie_first + tie_last) / 2.0)[tie_id_S]
    return order_S, avg_pos_S - first_of_group_S + 1.0


def _per_group_auc(group_S: np.ndarray, scores_S: np.ndarray, labels_S: np.ndarray):
    """Mann-Whitney AUC per group. Returns (groups_G, auc_G with NaN for one-class groups,
    count_G)."""
    order_S, ranks_S = _average_ranks_within_groups(group_S, scores_S)
    g_S, y_S = group_S[order_S], labels_S[order_S]
    groups_G, inverse_S, count_G = np.unique(g_S, return_inverse=True, return_counts=True)
    pos_G = np.bincount(inverse_S, weights=y_S, minlength=len(groups_G))
    neg_G = count_G - pos_G
    rank_sum_pos_G = np.bincount(inverse_S, weights=ranks_S * y_S, minlength=len(groups_G))
    with np.errstate(divide="ignore", invalid="ignore"):
        auc_G = (rank_sum_pos_G - pos_G * (pos_G + 1) / 2.0) / (pos_G * neg_G)
    auc_G[(pos_G == 0) | (neg_G == 0)] = np.nan
    return groups_G, auc_G, count_G


def binary_auc(scores_S: np.ndarray, labels_S: np.ndarray) -> float | None:
    """Mann-Whitney AUC, ties get half credit; None when only one class is present."""
    scores_S = np.asarray(scores_S, dtype=np.float64)
    _, auc, _ = _per_group_auc(np.zeros(len(scores_S), dtype=np.int64), scores_S, np.asarray(labels_S, np.float64))
    return None if len(auc) == 0 or np.isnan(auc[0]) else float(auc[0])


def _entropy(p: float) -> float:
    return -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))


def _none_if_nan(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def ranking_task_metrics(
    user_ids_S: np.ndarray, probs_S: np.ndarray, labels_S: np.ndarray, num_bins: int = 10
) -> dict[str, Any]:
    """All ranking metrics of one task over flat arrays (see the module docstring)."""
    n = int(len(probs_S))
    out: dict[str, Any] = {"count": n, "positives": int(labels_S.sum()) if n else 0}
    edges = np.arange(num_bins + 1) / num_bins  # exact decimals: linspace's third edge is 0.30000000000000004
    # Bins are [low, high), the last one [low, 1]; searching the edge array (not p * num_bins)
    # keeps a prediction of exactly 0.3 in the bin that starts at 0.3.
    bin_S = np.searchsorted(edges[1:-1], probs_S, side="right")
    bin_count = np.bincount(bin_S, minlength=num_bins)
    bin_pred = np.bincount(bin_S, weights=probs_S, minlength=num_bins)
    bin_pos = np.bincount(bin_S, weights=labels_S, minlength=num_bins)
    out["reliability"] = [
        {
            "bin_low": float(edges[i]),
            "bin_high": float(edges[i + 1]),
            "count": int(bin_count[i]),
            "mean_pred": float(bin_pred[i] / bin_count[i]) if bin_count[i] else None,
            "observed": float(bin_pos[i] / bin_count[i]) if bin_count[i] else None,
        }
        for i in range(num_bins)
    ]
    if n == 0:
        out.update(auc=None, gauc=None, gauc_users=0, gauc_skipped_users=0, logloss=None, ne=None,
                   base_rate=None, mean_pred=None, calibration=None)
        return out
    base_rate = float(labels_S.mean())
    p_S = np.clip(probs_S, LOG_LOSS_EPS, 1.0 - LOG_LOSS_EPS)
    logloss = float(-(labels_S * np.log(p_S) + (1.0 - labels_S) * np.log1p(-p_S)).mean())
    _, auc_G, count_G = _per_group_auc(user_ids_S, probs_S, labels_S)
    valid_G = ~np.isnan(auc_G)
    out.update(
        auc=binary_auc(probs_S, labels_S),
        gauc=float((auc_G[valid_G] * count_G[valid_G]).sum() / count_G[valid_G].sum()) if valid_G.any() else None,
        gauc_users=int(valid_G.sum()),
        gauc_skipped_users=int((~valid_G).sum()),
        logloss=logloss,
        ne=logloss / _entropy(base_rate) if 0.0 < base_rate < 1.0 else None,
        base_rate=base_rate,
        mean_pred=float(probs_S.mean()),
        calibration=float(probs_S.sum() / labels_S.sum()) if labels_S.sum() > 0 else None,
    )
    return out


class RankingMetrics:
    """Streaming multi-task ranking metrics. AUC and GAUC are exact, so every candidate's
    (user, prob, label) is kept: 8 + 9 * L bytes per candidate, only the ranking candidates
    (never the full-corpus retrieval scores).

    >>> m = RankingMetrics(tasks=["click", "conversion"])
    >>> m.update(user_ids_C, probs_CL, labels_CL)   # user_ids_C: the user of each candidate
    >>> m.compute()  # {"click": {"auc": ..., "gauc": ..., "ne": ..., ...}, "conversion": {...}}
    """

    def __init__(self, tasks: Sequence[str] = ("click", "conversion"), num_bins: int = 10):
        if not tasks:
            raise ValueError("RankingMetrics needs at least one task")
        self.tasks = list(tasks)
        self.num_bins = num_bins
        self._users: list[np.ndarray] = []
        self._probs: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []

    def update(self, user_ids_C: torch.Tensor, probs_CL: torch.Tensor, labels_CL: torch.Tensor) -> None:
        probs_CL = np.asarray(torch.as_tensor(probs_CL).detach().cpu(), dtype=np.float64)
        labels_CL = np.asarray(torch.as_tensor(labels_CL).detach().cpu(), dtype=np.float64)
        user_ids_C = np.asarray(torch.as_tensor(user_ids_C).cpu(), dtype=np.int64).reshape(-1)
        if probs_CL.ndim == 1 and len(self.tasks) == 1:
            probs_CL, labels_CL = probs_CL[:, None], labels_CL.reshape(-1, 1)
        expected = (len(user_ids_C), len(self.tasks))
        if probs_CL.shape != expected or labels_CL.shape != expected:
            raise ValueError(
                f"probs_CL {probs_CL.shape} and labels_CL {labels_CL.shape} must both be [C, L] = {expected} "
                f"for tasks {self.tasks}"
            )
        for j, task in enumerate(self.tasks):
            p, y = probs_CL[:, j], labels_CL[:, j]
            if not np.isfinite(p).all():
                raise ValueError(f"task '{task}': predicted probabilities contain NaN or inf")
            if ((p < 0.0) | (p > 1.0)).any():
                raise ValueError(f"task '{task}': predicted probabilities outside [0, 1] (pass probabilities, not logits)")
            if not ((y == 0.0) | (y == 1.0)).all():
                bad = y[~((y == 0.0) | (y == 1.0))][0]
                raise ValueError(f"task '{task}': labels must be 0 or 1, got {bad}")
        self._users.append(user_ids_C)
        self._probs.append(probs_CL)
        self._labels.append(labels_CL.astype(np.int8))

    def merge(self, other: "RankingMetrics") -> None:
        if other.tasks != self.tasks:
            raise ValueError(f"merge: tasks differ ({self.tasks} vs {other.tasks})")
        self._users += other._users
        self._probs += other._probs
        self._labels += other._labels

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._users:
            num_tasks = len(self.tasks)
            return np.zeros(0, np.int64), np.zeros((0, num_tasks)), np.zeros((0, num_tasks))
        return (np.concatenate(self._users), np.concatenate(self._probs),
                np.concatenate(self._labels).astype(np.float64))

    def compute(self) -> dict[str, dict[str, Any]]:
        users, probs, labels = self._arrays()
        return {
            task: ranking_task_metrics(users, probs[:, j], labels[:, j], self.num_bins)
            for j, task in enumerate(self.tasks)
        }

    def per_user(self, task: str) -> dict[str, np.ndarray]:
        """Per-user sums [U] for the bootstrap (users sorted by id): `user_ids`, `count`,
        `logloss_sum`, `pred_sum`, `label_sum`, and `auc` (NaN for one-class users).
        GAUC is bootstrapped as sum(auc * count) / sum(count) over users with an AUC."""
        if task not in self.tasks:
            raise ValueError(f"unknown task '{task}', expected one of {self.tasks}")
        users, probs, labels = self._arrays()
        p_S, y_S = probs[:, self.tasks.index(task)], labels[:, self.tasks.index(task)]
        groups_U, auc_U, count_U = _per_group_auc(users, p_S, y_S)
        inverse_S = np.searchsorted(groups_U, users)
        pc_S = np.clip(p_S, LOG_LOSS_EPS, 1.0 - LOG_LOSS_EPS)
        loss_S = -(y_S * np.log(pc_S) + (1.0 - y_S) * np.log1p(-pc_S))
        size = len(groups_U)
        return {
            "user_ids": groups_U,
            "count": count_U.astype(np.float64),
            "logloss_sum": np.bincount(inverse_S, weights=loss_S, minlength=size),
            "pred_sum": np.bincount(inverse_S, weights=p_S, minlength=size),
            "label_sum": np.bincount(inverse_S, weights=y_S, minlength=size),
            "auc": auc_U,
        }


# --------------------------------------------------------------------------- bootstrap


def _resample_sums(columns_UM: np.ndarray, num_resamples: int, seed: int) -> np.ndarray:
    """[R, M]: column sums over R resamples of the U users drawn with replacement. Each
    resample is a count vector (how often each user was drawn), generated in chunks so that
    memory stays at ~8M entries whatever U and R are."""
    num_users = columns_UM.shape[0]
    rng = np.random.default_rng(seed)
    out = np.empty((num_resamples, columns_UM.shape[1]))
    chunk = max(1, min(num_resamples, 8_000_000 // max(num_users, 1)))
    for start in range(0, num_resamples, chunk):
        stop = min(start + chunk, num_resamples)
        rows = stop - start
        # Offset each resample's draws into its own block so one bincount counts them all.
        draws = rng.integers(0, num_users, size=(rows, num_users)) + (np.arange(rows) * num_users)[:, None]
        counts_RU = np.bincount(draws.ravel(), minlength=rows * num_users).reshape(rows, num_users)
        out[start:stop] = counts_RU.astype(np.float64) @ columns_UM
    return out


def _as_columns(numer_U: Any, denom_U: Any | None) -> np.ndarray:
    numer = np.asarray(numer_U, dtype=np.float64).reshape(-1)
    denom = np.ones_like(numer) if denom_U is None else np.asarray(denom_U, dtype=np.float64).reshape(-1)
    if numer.shape != denom.shape:
        raise ValueError(f"bootstrap: numerator has {numer.size} users, denominator {denom.size}")
    if not (np.isfinite(numer).all() and np.isfinite(denom).all()):
        raise ValueError("bootstrap: per-user values contain NaN or inf (drop users without a value first)")
    return np.stack([numer, denom], axis=1)


def bootstrap_ci(numer_U: Any, denom_U: Any | None = None, num_resamples: int = 1000,
                 confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Percentile bootstrap CI of sum(numer) / sum(denom) resampling users (denom None: the
    mean). HR/NDCG/MRR: numer = per-user value. GAUC: numer = auc * count, denom = count.
    Log loss: numer = logloss_sum, denom = count. Deterministic for a seed."""
    cols = _as_columns(numer_U, denom_U)
    if cols.shape[0] == 0:
        return {"estimate": None, "low": None, "high": None, "confidence": confidence, "num_resamples": num_resamples}
    sums_R2 = _resample_sums(cols, num_resamples, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        stats_R = sums_R2[:, 0] / sums_R2[:, 1]
    alpha = (1.0 - confidence) / 2.0
    low, high = np.nanquantile(stats_R, [alpha, 1.0 - alpha])
    return {"estimate": float(cols[:, 0].sum() / cols[:, 1].sum()), "low": float(low), "high": float(high),
            "confidence": confidence, "num_resamples": num_resamples}


def paired_bootstrap(numer_a_U: Any, numer_b_U: Any, denom_a_U: Any | None = None, denom_b_U: Any | None = None,
                     num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Paired bootstrap of (metric A - metric B) over the same users (row u of both arrays is
    the same user): each resample draws users once and recomputes both metrics on them.
    p_value is two-sided, from the null-centred resamples: the share of |d* - d| >= |d|,
    with the +1 correction so it is never 0."""
    a, b = _as_columns(numer_a_U, denom_a_U), _as_columns(numer_b_U, denom_b_U)
    if a.shape != b.shape:
        raise ValueError(f"paired_bootstrap: model A has {a.shape[0]} users, model B {b.shape[0]}; "
                         "both must be evaluated on the same users in the same order")
    if a.shape[0] == 0:
        return {"diff": None, "low": None, "high": None, "p_value": None, "confidence": confidence,
                "num_resamples": num_resamples}
    sums_R4 = _resample_sums(np.concatenate([a, b], axis=1), num_resamples, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        diffs_R = sums_R4[:, 0] / sums_R4[:, 1] - sums_R4[:, 2] / sums_R4[:, 3]
    diff = float(a[:, 0].sum() / a[:, 1].sum() - b[:, 0].sum() / b[:, 1].sum())
    alpha = (1.0 - confidence) / 2.0
    low, high = np.nanquantile(diffs_R, [alpha, 1.0 - alpha])
    extreme = int((np.abs(diffs_R - diff) >= abs(diff) - 1e-15).sum())
    return {"diff": diff, "low": float(low), "high": float(high),
            "p_value": min(1.0, (extreme + 1) / (num_resamples + 1)),
            "confidence": confidence, "num_resamples": num_resamples}


def _ranking_ratio_columns(per_user: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(numerator, denominator) per user for the ranking figures that are ratios of sums."""
    has_auc = ~np.isnan(per_user["auc"])
    return {
        "gauc": (per_user["auc"][has_auc] * per_user["count"][has_auc], per_user["count"][has_auc]),
        "logloss": (per_user["logloss_sum"], per_user["count"]),
    }


def headline_cis(retrieval: RetrievalMetrics | None = None, ranking: RankingMetrics | None = None,
                 num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Bootstrap CIs keyed like the report (`retrieval.hr@10`, `ranking.click.gauc`, ...):
    every retrieval metric, and GAUC and log loss per ranking task (the global AUC is not a
    sum over users, so it gets no interval here)."""
    out: dict[str, dict[str, Any]] = {}
    if retrieval is not None:
        for name, values_U in retrieval.per_user().items():
            out[f"retrieval.{name}"] = bootstrap_ci(values_U, None, num_resamples, confidence, seed)
    if ranking is not None:
        for task in ranking.tasks:
            for name, (numer, denom) in _ranking_ratio_columns(ranking.per_user(task)).items():
                out[f"ranking.{task}.{name}"] = bootstrap_ci(numer, denom, num_resamples, confidence, seed)
    return out


def compare_models(a_retrieval: RetrievalMetrics | None, b_retrieval: RetrievalMetrics | None,
                   a_ranking: RankingMetrics | None = None, b_ranking: RankingMetrics | None = None,
                   num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Paired bootstrap of model A minus model B, keyed like `headline_cis`. Retrieval ranks are
    paired by position, so both accumulators must have been fed the same users in the same
    order; ranking is paired by user id (GAUC over the users that have an AUC in both)."""
    out: dict[str, dict[str, Any]] = {}
    if a_retrieval is not None and b_retrieval is not None:
        a_values, b_values = a_retrieval.per_user(), b_retrieval.per_user()
        for name in a_values:
            if name in b_values:
                out[f"retrieval.{name}"] = paired_bootstrap(a_values[name], b_values[name], None, None,
                                                            num_resamples, confidence, seed)
    if a_ranking is not None and b_ranking is not None:
        for task in a_ranking.tasks:
            if task not in b_ranking.tasks:
                continue
            a_pu, b_pu = a_ranking.per_user(task), b_ranking.per_user(task)
            if not np.array_equal(a_pu["user_ids"], b_pu["user_ids"]):
                raise ValueError(f"compare_models: task '{task}' was evaluated on different users for A and B")
            both = ~np.isnan(a_pu["auc"]) & ~np.isnan(b_pu["auc"])
            out[f"ranking.{task}.gauc"] = paired_bootstrap(
                a_pu["auc"][both] * a_pu["count"][both], b_pu["auc"][both] * b_pu["count"][both],
                a_pu["count"][both], b_pu["count"][both], num_resamples, confidence, seed)
            out[f"ranking.{task}.logloss"] = paired_bootstrap(
                a_pu["logloss_sum"], b_pu["logloss_sum"], a_pu["count"], b_pu["count"],
                num_resamples, confidence, seed)
    return out


class MeanOfRuns:
    """Several runs of one recipe (e.g. seeds) evaluated on the same users, as one model for
    `compare_models`: each user's per-user values averaged over the runs. A paired bootstrap
    of two such means over users compares the recipes with the training noise of each run
    averaged out, where one pair of runs leaves it in (its interval is wider than the
    recipes' difference warrants, and another seed can land on the other side)."""

    def __init__(self, retrieval: list[RetrievalMetrics], ranking: list[RankingMetrics]) -> None:
        self.retrieval_runs, self.ranking_runs = retrieval, ranking
        self.tasks = sorted(set.intersection(*(set(r.tasks) for r in ranking))) if ranking else []

    def per_user(self, task: str | None = None) -> dict[str, np.ndarray]:
        if task is None:  # retrieval
            values = [r.per_user() for r in self.retrieval_runs]
            return {k: np.mean([v[k] for v in values], axis=0) for k in values[0]}
        values = [r.per_user(task) for r in self.ranking_runs]
        for v in values[1:]:
            if not np.array_equal(v["user_ids"], values[0]["user_ids"]):
                raise ValueError(f"MeanOfRuns: task '{task}' was evaluated on different users by the runs")
        # A user without an AUC in some run (NaN) stays without one in the mean.
        return {k: (values[0][k] if k == "user_ids" else np.mean([v[k] for v in values], axis=0))
                for k in values[0]}
