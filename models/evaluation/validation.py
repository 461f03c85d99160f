"""Full-corpus retrieval evaluation shared by the trainer's validation and `genrec eval`.

Every user's held-out target is ranked against the whole item corpus (the prepared
data's item list), with the items already in the user's history removed. A target that
is not in the corpus (an item never seen in training) cannot be retrieved and counts as
a miss at every K (rank `metrics.MISSED`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.data.batch import Batch
from genrec.models.ids import sorted_positions
from genrec.models.ranks import all_reduce_sum
from genrec.models.evaluation.metrics import MISSED, RetrievalMetrics, rank_of_target
from genrec.models.model import GenerativeRecommender


VALIDATION_KS = (10,)
VALIDATION_METRICS = ("hr@10", "ndcg@10", "mrr")
"""What the trainer's validation reports (and may select the best checkpoint by)."""


def check_validation_settings(best_metric: str | None, early_stop_patience: int, retrieval: bool,
                              validates: bool = True) -> None:
    """ValueError naming the key, before training starts, for a `train.best_metric` that
    validation does not compute, and for a `train.early_stop_patience` that could never
    stop the run: it counts validations without a new best metric, and there is none
    without a best metric, without a retrieval head (validation scores retrieval only), or
    without validations (`validates` false: train.eval_every and eval_every_epochs both 0)."""
    if best_metric is not None and best_metric not in VALIDATION_METRICS:
        raise ValueError(f"train.best_metric {best_metric!r} is not computed by validation; "
                         f"choose one of {list(VALIDATION_METRICS)} or none")
    if early_stop_patience and (best_metric is None or not retrieval or not validates):
        why = ("train.best_metric is none" if best_metric is None else "model.retrieval is off" if not retrieval
               else "train.eval_every and train.eval_every_epochs are 0 (one validation, at the end)")
        raise ValueError(f"train.early_stop_patience = {early_stop_patience} would never stop the run: it counts "
                         f"validations without a new best train.best_metric, and {why}; set "
                         "train.early_stop_patience = 0")


def validation_batch_size(train_batch_size: int, num_items: int, max_scores: int = 1 << 26, cap: int = 2048) -> int:
    """Users per validation batch: one [users, corpus] score block stays under `max_scores`
    floats, never below the training batch size nor above `cap`."""
    return max(train_batch_size, min(cap, max_scores // max(num_items, 1)))


def target_ranks(
    scores_BN: torch.Tensor, target_ids_B: torch.Tensor, item_corpus: torch.Tensor,
    seen_ids_S: torch.Tensor, seen_lengths_B: torch.Tensor,
) -> torch.Tensor:
    """0-based rank of each target among the corpus scores, the user's seen items (jagged ids,
    those outside the corpus ignored) excluded; a target outside the corpus ranks `MISSED`
    (a miss at every K): int64 [B]."""
    num_users = len(target_ids_B)
    target_pos_B, target_found_B = sorted_positions(item_corpus, target_ids_B)
    seen_pos_S, seen_found_S = sorted_positions(item_corpus, seen_ids_S)
    rows_S = torch.repeat_interleave(torch.arange(num_users), seen_lengths_B)
    counts_B = torch.bincount(rows_S[seen_found_S], minlength=num_users)
    seen = (seen_pos_S[seen_found_S], torch.ops.fbgemm.asynchronous_complete_cumsum(counts_B))
    ranks_B = rank_of_target(scores_BN, target_pos_B, seen).cpu()
    return torch.where(target_found_B, ranks_B, torch.full_like(ranks_B, MISSED))


def last_window(batch: Batch, window: int | None) -> Batch:
    """`batch` with each history cut to its last `window` events (None: unchanged)."""
    lengths_B = batch.history_lengths_B
    if window is None or not lengths_B.numel() or int(lengths_B.max()) <= window:
        return batch
    keep_B = lengths_B.clamp(max=window)
    ends_B = batch.history_offsets_B1[1:]
    rows_T = torch.repeat_interleave(torch.arange(len(keep_B)), keep_B)
    starts_T = torch.repeat_interleave(ends_B - keep_B, keep_B)
    idx_T = starts_T + torch.arange(len(rows_T)) - torch.repeat_interleave(
        torch.ops.fbgemm.asynchronous_complete_cumsum(keep_B)[:-1], keep_B)
    keys = batch.history.keys()
    history = KeyedJaggedTensor(keys=keys, values=torch.cat([batch.history[k].values()[idx_T] for k in keys]),
                                lengths=keep_B.repeat(len(keys)))
    return Batch(user_ids_B=batch.user_ids_B, history=history, timestamps_T=batch.timestamps_T[idx_T],
                 history_lengths_B=keep_B, targets_B=batch.targets_B, query_time_B=batch.query_time_B)


def batch_ranks(
    model: GenerativeRecommender, batch: Batch, item_corpus: torch.Tensor, item_emb_ND: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Full-corpus rank of each user's target with every history item excluded (the whole
    history of `batch`, of which the model reads the last `window` events)."""
    if batch.query_time_B is None and batch.candidate_timestamps_C is not None:
        # An evaluation batch's one candidate per user is its target: the prediction's time.
        batch = dataclasses.replace(batch, query_time_B=batch.candidate_timestamps_C)
    user_BD = model.user_embeddings(last_window(batch, window))
    # Scores in fp32 whatever the caller's autocast: bf16 scores tie often, and a tie ranks
    # the target below every item it ties with.
    with torch.autocast(user_BD.device.type, enabled=False):
        scores_BN = user_BD.float() @ item_emb_ND.float().T
    return target_ranks(scores_BN, batch.targets_B, item_corpus,
                        batch.history[model.features.item].values(), batch.history_lengths_B)


def empty_batch(features) -> Batch:
    """An evaluation batch of no users: what a rank that has scored all of its users takes
    while others still score theirs (the sharded store's lookups are collective)."""
    z = torch.zeros(0, dtype=torch.int64)
    history = KeyedJaggedTensor(keys=list(features.sparse), values=z, lengths=z, stride=0)
    return Batch(user_ids_B=z, history=history, timestamps_T=z, history_lengths_B=z, targets_B=z,
                 candidate_timestamps_C=z)


@torch.no_grad()
def evaluate_retrieval(
    model: GenerativeRecommender, batches: Iterable[Batch], ks: Sequence[int] = (10, 50, 200),
    window: int | None = None, max_users: int | None = None,
) -> dict[str, float]:
    """HR@K, NDCG@K and MRR over all ranks' users (summed across ranks when distributed).
    `batches` carry whole histories (seen items are all of them); the model reads the last
    `window` events, as `genrec eval` does. `max_users`: this rank counts its first users
    up to this many (the rest of a batch that crosses it is scored and not counted)."""
    item_corpus = model.item_corpus
    item_emb_ND = model.item_embeddings(item_corpus)
    metrics = RetrievalMetrics(ks=ks, keep_ranks=False)
    for batch in batches:
        ranks = batch_ranks(model, batch, item_corpus, item_emb_ND, window)
        metrics.update_ranks(ranks if max_users is None else ranks[: max(max_users - metrics.count, 0)])
    names = metrics.metric_names
    local = metrics.compute()
    sums = all_reduce_sum([metrics.count] + [(local[n] or 0.0) * metrics.count for n in names])
    count = int(sums[0])
    return {"num_users": count, **{n: (s / count if count else float("nan")) for n, s in zip(names, sums[1:])}}
