"""The time bucketing of HSTU's relative attention bias: the reference formula.

Kept apart from `kernels.py` (the PyTorch attention) and `fused.py` (the C tile) because
both need it (and `triton_hstu.py`): the native kernels' bucket thresholds are derived from this
very function, so that they agree with it bit for bit.
"""

from __future__ import annotations

import functools

import torch


def time_buckets(dt: torch.Tensor, num_buckets: int, divisor: float) -> torch.Tensor:
    """floor(log(max(|dt|, 1)) / divisor) clamped to [0, num_buckets] (the reference's bucketing)."""
    return (torch.log(dt.abs().clamp(min=1).float()) / divisor).long().clamp(0, num_buckets)


@functools.lru_cache(maxsize=8)
def time_thresholds(num_buckets: int, divisor: float) -> torch.Tensor:
    """int64 [num_buckets + 2]: entry b is the smallest |dt| >= 1 whose bucket is >= b under
    the reference formula (found by bisection with that very formula, so the C side agrees
    with PyTorch bit for bit); entry 0 is 0, unreachable buckets and entry NB + 1 int64 max."""
    target = torch.arange(1, num_buckets + 1)
    lo = torch.ones(num_buckets, dtype=torch.long)                # bucket(lo) < target (or lo = 1)
    # The whole |dt| range: with many buckets (over 142 at divisor 0.301) gaps past 2**62
    # have buckets of their own, which a smaller bound would call unreachable.
    hi = torch.full((num_buckets,), 2**63 - 1, dtype=torch.long)  # candidate answer
    reachable = time_buckets(hi, num_buckets, divisor) >= target
    for _ in range(64):
        mid = lo + (hi - lo) // 2  # lo + hi would overflow int64
        ok = time_buckets(mid, num_buckets, divisor) >= target
        hi = torch.where(ok, mid, hi)
        # A lane already found (lo == hi, the last one int64 max) stays: mid + 1 would wrap
        # to int64 min there, and the loop would never see every lane done.
        lo = torch.where(ok | (lo >= hi), lo, mid + 1)
        if bool((lo >= hi).all()):
            break
    thr = torch.where(reachable, hi, torch.full_like(hi, 2**63 - 1))
    # Sentinels so the C side can look at thr[b] and thr[b + 1] for every b in [0, NB].
    return torch.cat([torch.zeros(1, dtype=torch.long), thr, torch.full((1,), 2**63 - 1)])
