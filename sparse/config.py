"""Configuration of the sparse side: one `TableConfig` per embedding table, one `SparseConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class TableConfig:
    """One embedding table: its features, rows, optimizer, admission, eviction and tiers."""

    name: str
    """Table name; also names its snapshot files and its SSD sub-directory."""
    embedding_dim: int
    """Row width D."""
    feature_names: list[str]
    """KJT keys that read this table (several features may share one table)."""
    num_embeddings: int | None = None
    """Upper bound on ids (ids must be in [0, num_embeddings)); None = unbounded int64 ids."""
    dtype: Literal["fp32"] = "fp32"
    """Storage dtype of rows and optimizer state (fp32 only: the exactness contract)."""
    seed: int = 0
    """Table seed: row `id` is initialized from (seed, id) alone, whatever arrives first."""
    initializer: Literal["uniform", "normal", "zeros"] = "uniform"
    """Row initializer."""
    init_scale: float | None = None
    """uniform: bound a of U(-a, a); normal: std. None = sqrt(1 / num_embeddings) when
    bounded (TorchRec's default), else 0.01."""
    optimizer: Literal["rowwise_adagrad", "adam", "sgd"] = "rowwise_adagrad"
    """Sparse optimizer applied in backward to touched rows only."""
    learning_rate: float = 0.01
    """Step size."""
    eps: float = 1e-8
    """Adagrad / Adam epsilon (FBGEMM's default 1e-8)."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.999
    """Adam second-moment decay."""
    weight_decay: float = 0.0
    """L2 weight decay added to the gradient (FBGEMM WeightDecayMode.L2)."""
    admit_min_count: int = 1
    """An id gets a row once it has been seen this many times in training forwards
    (1 = admit at first sight)."""
    admit_probability: float = 1.0
    """The sighting that reaches admit_min_count, and each later one while the id is not
    admitted, admits it with this probability: a batch with k such sightings admits it
    with 1 - (1 - p)^k (min_count 3, p 0.25, 3 sightings in one batch: 25%), drawn
    deterministically from (seed, id, sightings before the batch), so the outcome does not
    depend on sharding or arrival order."""
    admit_max_pending: int = 1 << 20
    """Cap on ids counted toward admission but not admitted, per rank (about 100 bytes
    each). Past it the least recently seen are forgotten first (then the least seen, then
    the lowest id); with ttl_seconds, a count also lapses that long after its last sighting."""
    default_row: Literal["zeros", "init"] = "zeros"
    """What unadmitted (or, in eval, unknown) ids read: zeros, or the id's would-be
    initial row. They never receive updates."""
    cache_policy: Literal["lru", "lfu"] = "lru"
    """Which rows are dropped first under max_rows: least recently used, or least
    frequently used (ties: least recent, then lowest id). The device / host caches follow
    it too: exactly with kernels="reference", by CLOCK (lru) or generalized CLOCK, a count
    of up to 7 per row (lfu), with native kernels, which never scan a tier to choose."""
    ttl_seconds: int | None = None
    """Rows not updated for this many seconds of event time are dropped from every tier."""
    max_rows: int | None = None
    """Cap on materialized rows of this table on one rank; rows past it are dropped by
    `cache_policy`. None = unlimited (the SSD tier grows)."""
    device_rows: int = 65536
    """Device cache capacity in rows (CUDA memory on GPU, process memory on CPU)."""
    host_rows: int = 1 << 20
    """Host DRAM cache capacity in rows; rows beyond device + host go to the SSD tier."""


@dataclass(kw_only=True)
class SparseConfig:
    """The whole sparse side: tables and store-wide settings."""

    tables: list[TableConfig] = field(default_factory=list)
    """Embedding tables."""
    ssd_dir: str | None = None
    """Existing, writable directory for the SSD tier (one sub-directory per table and
    rank, recreated empty when a store opens: durability comes from snapshots). One live
    store per rank may use it (a lock file per rank enforces that). None = a fresh
    temporary directory, deleted when the store goes and cleaned by the next store if its
    process was killed."""
    ssd_slab_rows: int = 1 << 18
    """Rows per memory-mapped slab file of the SSD tier."""
    snapshot_max_deltas: int = 8
    """Incremental snapshots: a snapshot (a checkpoint's) writes only the rows changed since
    the previous one, up to this many deltas in a row; then a full one (0: always full).
    A delta costs a pass over the table's metadata and the changed rows' bytes; a load
    reads the chain (at most this many deltas more than a full snapshot).
    Each snapshot folder still holds its whole chain (hard links), so pruning old
    checkpoints never breaks a kept one (snapshot.py)."""
    device: str | None = None
    """Device of the device tier and of the outputs ("cpu", "cuda", "cuda:1"). None: the
    trainer's device (this rank's GPU under torchrun on CUDA, else the CPU); a store built
    on its own takes the CPU."""
    read_ahead: Literal["auto", "on", "off"] = "auto"
    """Whether the trainer (with train.pipeline) starts the disk reads of batch t + 1's
    SSD-tier rows before step t (TieredEmbeddingCollection.read_ahead): "auto" is on with
    one rank and off with several, where it costs an extra id all-to-all per step whether
    or not any row sits on SSD. Advice only: results are the same either way."""
    kernels: Literal["native", "reference"] = "native"
    """The store's kernels: "native" (csrc/store.c, built by the install command: the
    index, the fused lookup and optimizer step, CLOCK cache victims, the TTL sweep) or
    "reference" (the same in PyTorch, several times slower, for a platform without a C
    compiler; the rows are the same bit for bit). Native kernels that cannot load are an
    error saying why, never a silent switch."""
