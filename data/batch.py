"""`Batch`: what the loader yields and the model consumes.

Worked example (2 users, feature spec sparse = ["item_id", "action"], labels = ["click"]):

    user 7 history: items [11, 12, 13] actions [1, 0, 1] at ts [100, 160, 200]
    user 9 history: items [21]         actions [1]       at ts [50]

    batch.history   KeyedJaggedTensor, keys ["item_id", "action"], key-major:
                    values  [11, 12, 13, 21,   1, 0, 1, 1]
                    lengths [3, 1,             3, 1]
    batch.history_lengths_B   [3, 1]      (the same for every key)
    batch.history_offsets_B1  [0, 3, 4]
    batch.timestamps_T        [100, 160, 200, 50]   (aligned with each key's values)
    batch.user_ids_B          [7, 9]

Ranking (candidates appended after the history under the target-aware mask):

    user 7 candidates: items [31, 32] with click labels [1, 0] at ts [210, 210]
    user 9 candidates: items [41]     with click label  [0]    at ts [60]

    batch.candidates          KeyedJaggedTensor, same keys, lengths [2, 1, 2, 1]
    batch.candidate_timestamps_C  [210, 210, 60]
    batch.labels_CL           float [[1.], [0.], [0.]]   (columns in feature-spec label order)

Evaluation (leave-one-out): `targets_B` holds the held-out next item of each user,
and the history is everything before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class Batch:
    user_ids_B: torch.Tensor
    """int64 [B]: user keys (hashed when the log had string keys)."""
    history: KeyedJaggedTensor
    """Per-event sparse features, one key per `FeatureSpec.sparse` entry, every key with
    the same per-user lengths (the history length after truncation)."""
    timestamps_T: torch.Tensor
    """int64 [sum(history_lengths_B)]: event times aligned with each key's values."""
    history_lengths_B: torch.Tensor
    """int64 [B]."""
    candidates: KeyedJaggedTensor | None = None
    """Ranking candidates, same keys as `history`; None when ranking is off."""
    candidate_timestamps_C: torch.Tensor | None = None
    """int64 [sum(candidate lengths)]."""
    labels_CL: torch.Tensor | None = None
    """float32 [C, num_labels]: 0/1 labels per candidate and task."""
    targets_B: torch.Tensor | None = None
    """int64 [B]: the held-out next item per user (evaluation splits only)."""
    query_time_B: torch.Tensor | None = None
    """int64 [B]: when the prediction from each user's last history event is made (the
    target's time in evaluation, the request time in serving); None: unknown."""

    @property
    def batch_size(self) -> int:
        return int(self.user_ids_B.numel())

    @property
    def history_offsets_B1(self) -> torch.Tensor:
        return torch.ops.fbgemm.asynchronous_complete_cumsum(self.history_lengths_B)

    @property
    def num_tokens(self) -> int:
        return int(self.timestamps_T.numel())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        def move(x):
            return None if x is None else x.to(device, non_blocking=non_blocking)

        return Batch(
            user_ids_B=move(self.user_ids_B),
            history=move(self.history),
            timestamps_T=move(self.timestamps_T),
            history_lengths_B=move(self.history_lengths_B),
            candidates=move(self.candidates),
            candidate_timestamps_C=move(self.candidate_timestamps_C),
            labels_CL=move(self.labels_CL),
            targets_B=move(self.targets_B),
            query_time_B=move(self.query_time_B),
        )
