"""Full-corpus retrieval evaluation shared by the trainer's validation and `genrec eval`.

Every user's held-out target is ranked against the whole item corpus (the prepared
data's item list), with the items already in the user's history removed. A target that
is not in the corpus (an item never seen in training) cannot be retrieved and counts as
a miss at rank N.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from genrec.data.batch import Batch
from genrec.models.distributed import all_reduce_sum
from genrec.models.metrics import RetrievalMetrics, rank_of_target
from genrec.models.model import GenerativeRecommender


def corpus_index(item_corpus: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of `ids` in the sorted `item_corpus`, and whether each id is in it."""
    pos = torch.searchsorted(item_corpus, ids).clamp_(max=max(len(item_corpus) - 1, 0))
    found = item_corpus[pos] == ids if len(item_corpus) else torch.zeros_like(ids, dtype=torch.bool)
    return pos, found


def batch_ranks(
    model: GenerativeRecommender, batch: Batch, item_corpus: torch.Tensor, item_emb_ND: torch.Tensor
) -> torch.Tensor:
    """0-based full-corpus rank of each user's target, seen items excluded: int64 [B]."""
    user_BD = model.user_embeddings(batch)
    scores_BN = user_BD @ item_emb_ND.T
    target_pos, target_found = corpus_index(item_corpus, batch.targets_B)
    seen_ids = batch.history[model.features.item].values()
    seen_pos, seen_found = corpus_index(item_corpus, seen_ids)
    rows = torch.repeat_interleave(torch.arange(batch.batch_size), batch.history_lengths_B)
    exclude_BN = torch.zeros_like(scores_BN, dtype=torch.bool)
    exclude_BN[rows[seen_found], seen_pos[seen_found]] = True
    ranks = rank_of_target(scores_BN, target_pos, exclude_BN)
    return torch.where(target_found, ranks, torch.full_like(ranks, len(item_corpus)))


@torch.no_grad()
def evaluate_retrieval(
    model: GenerativeRecommender, batches: Iterable[Batch], ks: Sequence[int] = (10, 50, 200)
) -> dict[str, float]:
    """HR@K, NDCG@K and MRR over all ranks' users (summed across ranks when distributed)."""
    item_corpus = model.item_corpus
    item_emb_ND = model.item_embeddings(item_corpus)
    metrics = RetrievalMetrics(ks=ks, keep_ranks=False)
    for batch in batches:
        metrics.update_ranks(batch_ranks(model, batch, item_corpus, item_emb_ND))
    names = metrics.metric_names
    local = metrics.compute()
    sums = all_reduce_sum([metrics.count] + [(local[n] or 0.0) * metrics.count for n in names])
    count = int(sums[0])
    return {"num_users": count, **{n: (s / count if count else float("nan")) for n, s in zip(names, sums[1:])}}
