"""genrec.sparse: raw int64 ids -> embedding rows from a tiered (device / host / SSD),
row-wise sharded store with exact sparse optimizers fused into backward.

Public API:
    TableConfig, SparseConfig                    configuration (sparse/config.py)
    TieredEmbeddingCollection                    KJT -> dict[str, JaggedTensor] (sparse/module.py)
        .set_event_time(ts) / forward(kjt, event_time=ts)   event time for TTL
        .prefetch(kjt)                           bring the next batch's rows up
        .save_snapshot(dir) / .load_snapshot(dir)
        .stats()
    save_snapshot, load_snapshot                 (sparse/snapshot.py)
    export_quantized                             fp16 / int8 row-wise shards for serving
"""

from .config import SparseConfig, TableConfig
from .module import TieredEmbeddingCollection

__all__ = ["SparseConfig", "TableConfig", "TieredEmbeddingCollection"]
