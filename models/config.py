"""The one config tree of a genrec job. Run files in `configs/*.toml` load into `JobConfig`.

    [data]    where the prepared data is, the feature spec, split and loader settings
    [sparse]  embedding tables and the tiered store
    [dense]   the sequence tower
    [model]   token combination and heads
    [train]   steps, optimizer, precision, checkpoints, logging
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from genrec.data.config import FeatureSpec
from genrec.data.loader import LoaderConfig
from genrec.data.prepare import PrepareConfig
from genrec.dense.config import TowerConfig
from genrec.models.model import ModelConfig
from genrec.sparse.config import SparseConfig


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW for the dense parameters plus a linear-warmup cosine schedule."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay on matrices; norms and biases get none."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr/warmup_steps up to lr."""
    min_lr_ratio: float = 0.1
    """Cosine decay from lr (the first step after warm-up) towards lr * min_lr_ratio, which
    the schedule reaches at max_steps: the last step runs just above it."""
    grad_clip_norm: float | None = 1.0
    """Clip the global dense-gradient L2 norm to this; None turns clipping off."""

    def __post_init__(self) -> None:
        _check("train.optim", self, nonnegative=("lr", "weight_decay", "warmup_steps"),
               positive=("eps", "grad_clip_norm"), fraction=("min_lr_ratio",), decay=("betas",))
        if len(self.betas) != 2:
            raise ValueError(f"train.optim.betas must be two numbers in [0, 1), got {self.betas}")


_RANGES = {"positive": (lambda v: v > 0, "> 0"), "nonnegative": (lambda v: v >= 0, ">= 0"),
           "fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"), "decay": (lambda v: 0 <= v < 1, "in [0, 1)"),
           "probability": (lambda v: 0 < v <= 1, "in (0, 1]")}


def _check(section: str, obj: object, **names: tuple[str, ...]) -> None:
    """ValueError naming `section.key` for a number out of range (`positive=("lr",)`, or
    nonnegative, fraction [0, 1], decay [0, 1), probability (0, 1]) or not finite, and
    `section.key[i]` for an item of a list; an optional key left unset (None) passes. NaN
    fails every comparison, inf is refused by name."""
    for kind, keys in names.items():
        ok, wanted = _RANGES[kind]
        for name in keys:
            value = getattr(obj, name)
            items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
            for i, item in items:
                if item is not None and not (ok(item) and math.isfinite(item)):
                    key = name if i is None else f"{name}[{i}]"
                    raise ValueError(f"{section}.{key} must be a finite number {wanted}, got {item}")


@dataclass(kw_only=True)
class DataConfig:
    """Where the prepared data lives, what its columns mean, how it is split and read."""

    path: str = "runs/data"
    """Prepared data directory (the output of `genrec prepare`)."""
    features: FeatureSpec = field(default_factory=FeatureSpec)
    """Which columns are ids, times, labels and the user key."""
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    """`genrec prepare`: split, memory budget, shards."""
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    """Batches for training (evaluation reuses it in eval mode)."""


@dataclass(kw_only=True)
class TrainConfig:
    out_dir: str = "runs/default"
    """Run directory: checkpoints/, metrics.jsonl, TensorBoard events."""
    max_steps: int = 1000
    """Optimizer steps to train for (the schedule's length); ignored when `num_epochs` is set."""
    num_epochs: int | None = None
    """Train for this many passes over the training split instead of `max_steps` (steps per
    epoch: training rows / (batch size * ranks), rounded up)."""
    seed: int = 0
    """Seeds parameters, dropout and negative sampling. The data order is `data.loader.seed`'s."""
    deterministic: bool = True
    """Deterministic kernels and data order: a resumed run repeats the same losses."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Autocast dtype of the dense tower; master weights stay fp32. fp16 is refused on CUDA
    (its loss scaling would reach the sparse rows, stepped inside backward; on CPU the scaler
    is off). "auto": bf16 on CUDA, fp32 on CPU (where bf16 autocast measured slower end to end:
    5.7K vs 7.3K tokens/s on the demo model, 2-core machine)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Dense optimizer and schedule (sparse rows have their table's own optimizer)."""
    checkpoint_every: int = 500
    """Checkpoint every this many steps (and on SIGTERM / SIGINT and at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk."""
    log_every: int = 10
    """Steps between metric lines (metrics.jsonl, TensorBoard, progress bar)."""
    eval_every: int = 0
    """Steps between validations (HR@10, NDCG@10 on the validation split); 0 = only at the end."""
    eval_every_epochs: int = 0
    """Validate every this many epochs instead (0: use `eval_every`)."""
    eval_max_users: int = 2000
    """Validation users scored per validation (full item corpus each): the split's first
    this many, the same users on any world size; 0 = the whole split."""
    eval_batch_size: int = 0
    """Users scored at once in validation; 0: as many as keep one [users, corpus] score block
    under 2^26 floats (256 MB), between `data.loader.batch_size` and 2048. The tower's
    per-call overhead dominates small batches: Beauty's 22K validation users took 5.2 s at
    128, 2.6 s at 2048 (2 threads), with the same metrics."""
    best_metric: str | None = "ndcg@10"
    """Validation metric ("hr@10", "ndcg@10" or "mrr") whose best value picks the `best`
    checkpoint, which is never pruned and which `genrec eval` uses by default. None: off."""
    early_stop_patience: int = 0
    """Stop after this many validations without a new best (0: never stop early)."""
    tensorboard: bool = True
    """Also write TensorBoard event files."""
    dense_parallel: Literal["ddp", "fsdp2"] = "ddp"
    """How the dense model is data-parallel under torchrun: "ddp" replicates it and
    all-reduces gradients; "fsdp2" shards it over the ranks (`fully_shard`: weights
    gathered per layer around forward and backward, gradients reduce-scattered), for dense
    models too large to replicate. Both train the same numbers; DDP is faster when the
    model fits."""
    pipeline: bool = True
    """Load the next batches in a thread while the current one computes, and (see
    sparse.read_ahead) start the disk reads of the next batch's SSD-tier rows."""
    cpu_affinity: Literal["auto", "off"] = "auto"
    """"auto": on CPU with several ranks on a node, bind each local rank's threads that
    compute (training, intra-op, loader) to its own share of the cores this process may
    use, as `torch.backends.xeon.run_cpu` does per instance; the collectives' own threads
    (gloo's I/O loop and workers) stay free to wake on any of them. Nothing bound, the
    2-rank step of the demo model took 63 ms where it took 57 with every thread bound (one
    A/B on 2 cores); with the collectives' threads left free it took 0.97 of that (median
    of 8 alternating pairs, 2 ranks on the same batches). "off": leave placement to the OS
    (nodes shared with other jobs)."""
    num_threads: int = 0
    """torch intra-op threads per rank; 0: the cores this process may use divided by the
    ranks on this node (never more threads than cores: oversubscribed, spin-waiting OpenMP
    threads measured 6-8x slower than one thread). `genrec` also sets OMP_WAIT_POLICY=PASSIVE
    unless the environment says otherwise."""

    def __post_init__(self) -> None:
        _check("train", self, positive=("max_steps", "checkpoint_every", "log_every", "keep_checkpoints"),
               nonnegative=("eval_every", "eval_every_epochs", "eval_max_users", "eval_batch_size", "early_stop_patience",
                            "num_threads"))
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"train.num_epochs must be >= 1 or unset, got {self.num_epochs}")
        check_seed(self.seed, "train.seed")  # torch's error named no key, after the run folder was made


def check_seed(seed: int, key: str) -> None:
    """ValueError naming `key` for a seed outside numpy's range [0, 2**32 - 1]."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"{key} must be in [0, 2**32 - 1], got {seed}")


@dataclass(kw_only=True)
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    dense: TowerConfig = field(default_factory=TowerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        # The sections that do not check their own numbers, named as a run file names them
        # (a NaN rate or a zero temperature otherwise surfaced steps later as a NaN loss).
        _check("model", self.model, positive=("temperature", "contrastive_temperature", "num_negatives",
                                              "full_softmax_max_items", "ranking_hidden_dim"),
               nonnegative=("retrieval_weight", "contrastive_weight", "task_weights"))
        features = self.data.features
        if self.model.retrieval and self.model.min_target_action is not None and features.action not in features.sparse:
            # the loader reads only the sparse columns: a KeyError at the first step otherwise
            raise ValueError(f"model.min_target_action reads each event's action, but data.features.action "
                             f"({features.action!r}) is not in data.features.sparse {features.sparse}")
        _check("data.loader", self.data.loader, positive=("batch_size", "max_seq_len", "num_candidates",
                                                          "prefetch_factor"),
               nonnegative=("stochastic_length_min", "num_workers", "seed"),  # seed: numpy's error named no key
               fraction=("stochastic_length_prob", "random_end_prob"))
        if self.data.loader.max_seq_len > self.dense.max_seq_len:  # else refused at the first long row
            raise ValueError(f"data.loader.max_seq_len ({self.data.loader.max_seq_len}) is longer than "
                             f"dense.max_seq_len ({self.dense.max_seq_len}): the loader's windows must fit the "
                             "tower; lower the first or raise the second")
        _check("sparse", self.sparse, positive=("ssd_slab_rows",), nonnegative=("snapshot_max_deltas",))
        # TowerConfig checks its sizes and rates, not these: a zero divisor failed in the first
        # forward, a NaN one or a NaN epsilon trained (NaN losses), after the run folder was made.
        _check("dense", self.dense, positive=("time_bucket_divisor", "layer_norm_eps"))
        if self.sparse.device is not None:
            try:
                torch.device(self.sparse.device)
            except RuntimeError:
                raise ValueError(f"sparse.device must name a torch device (cpu, cuda, cuda:1) or be unset, "
                                 f"got {self.sparse.device!r}") from None
        for table in self.sparse.tables:
            _check(f"sparse.tables.{table.name}", table,
                   positive=("embedding_dim", "num_embeddings", "eps", "admit_min_count", "admit_max_pending",
                             "ttl_seconds", "max_rows"),
                   nonnegative=("learning_rate", "weight_decay", "init_scale", "device_rows", "host_rows"),
                   decay=("beta1", "beta2"), probability=("admit_probability",))
