"""Who this process is among its ranks, and the few collectives every room may use.

`DistInfo` is built by the training set-up (`models/train/distributed.py`) or, for a single
process (evaluation, export), by hand. The helpers are no-ops without a process group, so
evaluation code runs the same in one process and under `torchrun`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def single_process(device: str | torch.device = "cpu") -> DistInfo:
    """The DistInfo of a plain, one-process run."""
    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device(device))


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum plain numbers over ranks (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (itself without a process group)."""
    return bool(all_reduce_sum([float(flag)])[0] > 0)
