"""The one id -> row-position lookup: raw int64 ids against a sorted id list.

Used wherever ids meet a sorted table: the item corpus (validation, evaluation, the
ranker's item side features) and the serving artifact's embedding tables.
"""

from __future__ import annotations

import torch


def sorted_positions(sorted_ids_N: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each id in the strictly increasing `sorted_ids_N`, clamped into range;
    whether the id is there). An empty list finds nothing (positions 0)."""
    n = sorted_ids_N.numel()
    if n == 0:
        return torch.zeros_like(ids), torch.zeros(ids.shape, dtype=torch.bool)
    pos = torch.searchsorted(sorted_ids_N, ids).clamp_(max=n - 1)
    return pos, sorted_ids_N[pos] == ids
