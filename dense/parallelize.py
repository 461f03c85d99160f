"""Apply per-layer activation checkpointing and torch.compile to a tower.

DDP / FSDP2 wrapping is the trainer's job (models/); this only touches the tower's blocks,
so model code stays free of parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from .tower import SequenceTower


def parallelize(tower: SequenceTower, *, activation_checkpointing: bool = False,
                compile: bool = False) -> nn.Module:
    """In place: checkpoint every layer (recompute in backward) and/or compile each block.

    Compiling per block (not the whole tower) keeps the jagged bookkeeping, which has
    data-dependent shapes, out of the graph.
    """
    tower.activation_checkpointing = activation_checkpointing
    if compile:
        for i, layer in enumerate(tower.layers):
            tower.layers[i] = torch.compile(layer, dynamic=True)
    return tower
