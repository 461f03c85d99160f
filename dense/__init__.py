"""genrec.dense: jagged per-event embeddings -> per-event sequence states (HSTU or Transformer).

The tower knows nothing about embedding tables, data files or parallelism. Holds the
tower and its blocks (HSTU, Transformer), the attention kernels (PyTorch reference, the C
tile), jagged layouts, precision and parallelization helpers, and the tower's benchmark.

May import: torch and fbgemm. Never `genrec.data`, `genrec.sparse` or `genrec.models` (a
ground floor).

Input is jagged:

    values_TD     float [T, D]   every row's tokens back to back
    offsets_B1    int64 [B + 1]  row b is values_TD[offsets_B1[b]:offsets_B1[b + 1]]
    timestamps_T  int64 [T]      event times (seconds), aligned with values_TD
    num_targets_B int64 [B] | None   the last num_targets_B[b] tokens of row b are ranking
                                     candidates (target-aware mask), None = plain causal
    query_time_B  int64 [B] | None   TowerConfig.time_bias_query="next" only: the time row b's
                                     last history event is scored at (e.g. the request time)

Example: users with 3 and 1 events, D = 64:

    cfg = TowerConfig(kind="hstu", embedding_dim=64, max_seq_len=256)
    tower = build_tower(cfg)
    out_TD = tower(torch.randn(4, 64), torch.tensor([0, 3, 4]), torch.tensor([100, 160, 200, 50]))
    # out_TD: [4, 64]; out_TD[0:3] are user 0's states, out_TD[3] user 1's.

Incremental ranking (history encoded once, candidates scored in micro-batches):

    states_TD, cache = tower.encode_history(hist_TD, hist_offsets_B1, hist_ts_T)
    cand_CD = tower.score_targets(cache, cand_CD, cand_offsets_B1, cand_ts_C)
"""

from .config import TowerConfig
from .kernels import KERNELS
from .parallelize import parallelize
from .precision import autocast, make_grad_scaler
from .tower import HistoryCache, SequenceTower, build_tower

__all__ = ["TowerConfig", "build_tower", "SequenceTower", "HistoryCache", "KERNELS",
           "parallelize", "autocast", "make_grad_scaler"]
