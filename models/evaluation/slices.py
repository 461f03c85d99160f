"""Slices of the evaluated users and items, and the most-popular baseline.

    user type       new (no training events) / returning
    history length  buckets of the history's length
    item popularity head / torso / tail of the training interactions

`SlicedMetrics` keeps one metric accumulator per slice value; `PopularityScorer` scores the
corpus by training counts, the baseline every report shows beside the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch


# --------------------------------------------------------------------------- slices


def new_vs_returning(train_event_counts_B: torch.Tensor | np.ndarray) -> np.ndarray:
    """'new' for users with no training events, 'returning' otherwise."""
    counts = np.asarray(torch.as_tensor(train_event_counts_B).cpu())
    return np.where(counts > 0, "returning", "new")


USER_TYPE_VALUES = ["new", "returning"]


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """Labels for integer buckets split at `edges`: (5, 20) -> ['0-4', '5-19', '20+']."""
    lows = [0, *edges]
    return [f"{lo}-{hi - 1}" for lo, hi in zip(lows[:-1], edges)] + [f"{lows[-1]}+"]


def length_buckets(lengths_B: torch.Tensor | np.ndarray, edges: Sequence[int] = (5, 20, 50, 200)) -> np.ndarray:
    """History-length bucket label per user, from `bucket_labels(edges)`."""
    edges = [int(e) for e in edges]
    if edges != sorted(set(edges)) or (edges and edges[0] <= 0):
        raise ValueError(f"history-length bucket edges must be strictly increasing and > 0, got {list(edges)}")
    lengths = np.asarray(torch.as_tensor(lengths_B).cpu())
    return np.asarray(bucket_labels(edges), dtype=object)[np.searchsorted(np.asarray(edges), lengths, side="right")]


POPULARITY_VALUES = ["head", "torso", "tail"]


def popularity_buckets(train_counts_N: torch.Tensor | np.ndarray, head_mass: float = 0.5,
                       torso_mass: float = 0.8) -> np.ndarray:
    """Bucket every item by train popularity: 'head' holds the most popular items that make up
    the first `head_mass` of training interactions, 'torso' those up to `torso_mass`, 'tail' the
    rest (including never-seen items). Items with equal counts always share a bucket, because
    the cut is a count threshold. Returns object [N]; index it with item indices."""
    if not 0.0 < head_mass <= torso_mass <= 1.0:
        raise ValueError(f"need 0 < head_mass <= torso_mass <= 1, got {head_mass}, {torso_mass}")
    counts = np.asarray(torch.as_tensor(train_counts_N).cpu(), dtype=np.float64)
    out = np.full(len(counts), "tail", dtype=object)
    total = counts.sum()
    if total <= 0:
        return out
    desc = np.sort(counts)[::-1]
    cum_share = np.cumsum(desc) / total

    def threshold(mass: float) -> float:
        # The count of the item at which the cumulative share first reaches `mass`.
        return desc[min(int(np.searchsorted(cum_share, mass - 1e-12)), len(desc) - 1)]

    torso_threshold = max(threshold(torso_mass), np.finfo(np.float64).tiny)
    out[counts >= torso_threshold] = "torso"
    out[counts >= threshold(head_mass)] = "head"
    return out


class SlicedMetrics:
    """One accumulator per (slice column, value), fed row-aligned slice labels.

    >>> sliced = SlicedMetrics(lambda: RetrievalMetrics(ks=(10,)), method="update_ranks",
    ...                        columns={"user_type": USER_TYPE_VALUES, "country": None})
    >>> sliced.update({"user_type": new_vs_returning(train_counts_B), "country": country_B}, ranks_B)
    >>> sliced.compute()  # {"user_type": {"new": {...}, "returning": {...}}, "country": {...}}

    A declared value list (e.g. head / torso / tail) makes each value appear in `compute()` even
    with no rows (count 0, null metrics); None means an open categorical column whose values
    are taken as they come. A value outside a declared list is a ValueError.
    """

    def __init__(self, make_metrics: Callable[[], Any], columns: Mapping[str, Sequence[str] | None],
                 method: str = "update"):
        self.make_metrics = make_metrics
        self.method = method
        self.columns = {name: (list(values) if values is not None else None) for name, values in columns.items()}
        self.metrics: dict[str, dict[str, Any]] = {name: {} for name in columns}

    def update(self, slices: Mapping[str, Any], *rows: Any) -> None:
        """`slices[column]` holds one label per row; `rows` are the accumulator's `method`
        arguments, each indexed along its first dimension."""
        if set(slices) != set(self.columns):
            raise ValueError(f"slices: got columns {sorted(slices)}, expected {sorted(self.columns)}")
        num_rows = len(rows[0])
        for column, labels in slices.items():
            labels = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels).astype(str)
            if len(labels) != num_rows:
                raise ValueError(f"slice column '{column}': {len(labels)} labels for {num_rows} rows")
            declared = self.columns[column]
            for value in map(str, np.unique(labels)):
                if declared is not None and value not in declared:
                    raise ValueError(f"slice column '{column}': value '{value}' is not one of {declared}")
                idx = torch.from_numpy(np.flatnonzero(labels == value))
                acc = self.metrics[column].get(value)
                if acc is None:
                    acc = self.metrics[column][value] = self.make_metrics()
                getattr(acc, self.method)(*(_take(r, idx) for r in rows))

    def accumulator(self, column: str, value: str) -> Any:
        """The accumulator of one slice (a fresh, empty one if the slice has no rows yet)."""
        if value not in self.metrics[column]:
            self.metrics[column][value] = self.make_metrics()
        return self.metrics[column][value]

    def compute(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for column, declared in self.columns.items():
            values = declared if declared is not None else sorted(self.metrics[column])
            out[column] = {value: self.accumulator(column, value).compute() for value in values}
        return out


def _take(rows: Any, idx: torch.Tensor) -> Any:
    if isinstance(rows, np.ndarray):
        return rows[idx.numpy()]
    return rows[idx.to(rows.device)]


# --------------------------------------------------------------------------- baseline


def item_counts(train_item_idx: torch.Tensor, num_items: int) -> torch.Tensor:
    """int64 [N]: how often each item index occurs in the training events."""
    train_item_idx = torch.as_tensor(train_item_idx).long().reshape(-1)
    if train_item_idx.numel() and (int(train_item_idx.min()) < 0 or int(train_item_idx.max()) >= num_items):
        raise ValueError(f"train_item_idx: item index out of range [0, {num_items})")
    return torch.bincount(train_item_idx, minlength=num_items)


class PopularityScorer:
    """Most-popular baseline: every user gets the same scores, higher for items seen more in
    training. Equal counts are broken by lower item index so that the pessimistic tie rule
    does not punish the baseline for ties it did not choose; scores are distinct integers
    (N - position in the popularity order), exact in float32 up to 2**24 items.

    >>> pop = PopularityScorer(item_counts(train_items, num_items))
    >>> baseline.update(pop.scores(batch_size), target_idx_B, exclude=seen)
    """

    def __init__(self, train_counts_N: torch.Tensor):
        counts = torch.as_tensor(train_counts_N).long()
        order = torch.sort(-counts, stable=True).indices
        self.scores_N = torch.empty(len(counts), dtype=torch.float32)
        self.scores_N[order] = torch.arange(len(counts), 0, -1, dtype=torch.float32)

    def scores(self, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[B, N] view (no copy) of the shared score row."""
        return self.scores_N.to(device)[None, :].expand(batch_size, -1)

    def candidate_probs(self, item_idx_C: torch.Tensor) -> torch.Tensor:
        """float [C] in (0, 1], ordered like the popularity scores, to feed `RankingMetrics`
        for ranking candidates. Only the order-based figures (AUC, GAUC) mean anything for
        this baseline; its log loss and calibration do not."""
        return self.scores_N[torch.as_tensor(item_idx_C).long().cpu()] / len(self.scores_N)
