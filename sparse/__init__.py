"""genrec.sparse: raw int64 ids -> embedding rows.

A multi-tier (device / host DRAM / SSD), row-wise sharded embedding store whose sparse
optimizer (row-wise Adagrad with FBGEMM semantics, Adam, SGD) runs fused into backward.
Holds the store and its tiers, id hashing and ownership, the optimizers, atomic
reshardable snapshots, the table planner and the store's benchmark.

May import: torch, torch.distributed, torchrec's jagged types, fbgemm. Never `genrec.data`,
`genrec.dense` or `genrec.models` (a ground floor).

Worked example of the jagged input (2 users; item table shared by the history's item_id
and the negatives' neg_item_id):

    from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection
    cfg = SparseConfig(tables=[
        TableConfig(name="item", embedding_dim=64, feature_names=["item_id", "neg_item_id"],
                    device_rows=1 << 16, host_rows=1 << 20, admit_min_count=2, ttl_seconds=30 * 86400),
        TableConfig(name="action", embedding_dim=8, feature_names=["action"], num_embeddings=8),
    ], ssd_dir="/mnt/ssd/genrec")
    tec = TieredEmbeddingCollection(cfg)          # under torch.distributed: rows sharded by id hash

    user 7: items [11, 12, 13], actions [1, 0, 1];  user 9: items [21], actions [1]
    history = KeyedJaggedTensor.from_lengths_sync(
        keys=["item_id", "action"],
        values=torch.tensor([11, 12, 13, 21,   1, 0, 1, 1]),   # key-major
        lengths=torch.tensor([3, 1,            3, 1]),
    )
    out = tec(history, event_time=batch_max_ts)   # dict[str, JaggedTensor]
    out["item_id"].values()    # float32 [4, 64], rows of 11, 12, 13, 21 (zeros until admitted)
    out["item_id"].lengths()   # [3, 1]
    negs = tec(KeyedJaggedTensor.from_lengths_sync(keys=["neg_item_id"], values=..., lengths=...))
    loss.backward()            # the sparse optimizer has now updated every touched row

Public API
    TableConfig, SparseConfig        config dataclasses (config.py)
    TieredEmbeddingCollection        the module (module.py):
        forward(kjt, event_time=None) -> dict[str, JaggedTensor]
        set_event_time(ts)           event time for TTL and last-update stamps
        prefetch(kjt)                bring the next batch's rows up to the device tier
        read_ahead([kjt, ...])       start the disk reads of the next batch's SSD rows (advice only)
        save_snapshot(dir), load_snapshot(dir)   (collective under torch.distributed)
        stats()                      rows and hits per tier, misses, per table
    save_snapshot, load_snapshot     snapshot.py: atomic, CRC32-checked, reshardable
    plan_tables, TablePlan           planner.py: device / host rows per table from budgets

Checkpoints: the store provides save_snapshot / load_snapshot (a directory), not a
state_dict: rows can exceed memory. A snapshot holds every row with its optimizer state
and metadata, the admission counters, per-table step counters and the event time, so a
load followed by the same batches continues exactly. Take it between steps (after
backward) and on every rank at once. Trainers pair it with their dense checkpoint.
"""

from .config import SparseConfig, TableConfig
from .module import TieredEmbeddingCollection
from .planner import TablePlan, plan_tables
from .snapshot import load_snapshot, save_snapshot

__all__ = [
    "SparseConfig",
    "TablePlan",
    "TableConfig",
    "TieredEmbeddingCollection",
    "load_snapshot",
    "plan_tables",
    "save_snapshot",
]
