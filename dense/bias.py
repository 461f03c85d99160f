"""The time bucketing of HSTU's relative attention bias: the reference formula.

Kept apart from `kernels.py` (the PyTorch attention) and `fused.py` (the C tile) because
both need it: the C tile's bucket thresholds are derived from this very function, so that
the two agree bit for bit.
"""

from __future__ import annotations

import torch


def time_buckets(dt: torch.Tensor, num_buckets: int, divisor: float) -> torch.Tensor:
    """floor(log(max(|dt|, 1)) / divisor) clamped to [0, num_buckets] (the reference's bucketing)."""
    return (torch.log(dt.abs().clamp(min=1).float()) / divisor).long().clamp(0, num_buckets)
