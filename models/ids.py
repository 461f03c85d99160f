"""Positions shared by training, evaluation and serving: the one id -> row-position lookup
(raw int64 ids against a sorted id list), used wherever ids meet a sorted table (the item
corpus in training, validation and evaluation, the ranker's item side features, the
serving artifact's embedding tables); and per-row ranges of positions in jagged values.
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


def jagged_ranges(starts_B: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """Concatenated aranges [s, s + n) per row: the positions of each row's slice."""
    offsets_B1 = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths_B)
    total = int(offsets_B1[-1])
    return (torch.repeat_interleave(starts_B - offsets_B1[:-1], lengths_B, output_size=total)
            + torch.arange(total, device=starts_B.device))
